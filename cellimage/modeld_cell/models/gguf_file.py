"""A GGUF file's metadata and tensor table in one pass over a memory map, and its tensors dequantized whole.

The layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type u32, value)        string = u64 length + UTF-8 bytes
                array value = elem_type u32, count u64, count elems
    tensor_count x (name: string, n_dims u32, dims u64[n_dims] (ne0 first), ggml_type u32, offset u64)
    padding to ``general.alignment`` (default 32), then the data; a tensor's bytes start at data + offset.

Why not ``gguf.GGUFReader``: it builds a numpy memmap view per value, so SmolLM2's tokenizer (49,152 tokens and
48,900 merges) took 5.5 s to parse on a 2-core VM, paid by every worker, rank and test engine at start; this parse
takes a fraction of a second. Dequantization still uses the ``gguf`` package's block formulas (``gguf.quants``), on
whole tensors rather than 16-row groups, so the values are the package's, bit for bit
(tests/unit/test_gguf_file.py compares both readers on a file written by ``gguf.GGUFWriter``).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value types (gguf.GGUFValueType)
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}  # struct
_BOOL = 7


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]     # ggml order: ne0 (the contiguous dimension) first, as the file stores it
    ggml_type: int             # gguf.GGMLQuantizationType value
    offset: int                # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major shape (the reverse of ggml's): [rows, cols] for a matrix."""
        return tuple(reversed(self.shape))


class GGUFError(ValueError):
    pass


class GGUFFile:
    """``fields``: metadata key -> Python value (str, int, float, bool, or a list of them); ``tensors``: the tensor
    table in file order. The file stays memory-mapped until ``close`` (or the end of a ``with`` block)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:                      # an empty file cannot be mapped
                raise GGUFError(f"{self.path}: not a GGUF file ({e})") from None
        buf = self._map
        if len(buf) < 24 or buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (no 'GGUF' magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            hint = " (a big-endian file?)" if struct.unpack_from(">I", buf, 4)[0] in (2, 3) else ""
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3){hint}")
        self.version = version
        self._pos = 24
        try:
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                (vtype,) = self._unpack("<I")
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                (n_dims,) = self._unpack("<I")
                shape = self._unpack(f"<{n_dims}Q")
                ggml_type, offset = self._unpack("<IQ")
                infos.append((name, tuple(int(x) for x in shape), int(ggml_type), int(offset)))
        except struct.error as e:
            raise GGUFError(f"{self.path}: truncated GGUF header ({e})") from None
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data = -(-self._pos // align) * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: list[TensorInfo] = []
        for name, shape, ggml_type, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if shape and shape[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} rows of {shape[0]} are not whole {block}-value blocks")
            t = TensorInfo(name, shape, ggml_type, data + offset, n // block * type_size)
            if t.offset + t.nbytes > len(buf):
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors.append(t)

    # ---- header parsing

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        if self._pos > len(self._map):
            raise struct.error("a string runs past the end of the file")
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALAR:
            (v,) = self._unpack("<" + _SCALAR[vtype])
            return bool(v) if vtype == _BOOL else v
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype in _SCALAR:           # numbers in one read
                dt = np.dtype("<" + _SCALAR[etype])
                arr = np.frombuffer(self._map, dtype=dt, count=count, offset=self._pos)
                self._pos += dt.itemsize * count
                return [bool(x) for x in arr] if etype == _BOOL else arr.tolist()
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at byte {self._pos}")

    # ---- tensors

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored (uint8, a copy: the map may close)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset).copy()

    def dequantize(self, t: TensorInfo, rows_per_call: int = 4096) -> np.ndarray:
        """fp32 values in row-major shape (``t.torch_shape``), by ``gguf.quants``' formulas for the type, a few
        thousand rows a call (its own ``dequantize`` goes 16 rows at a time: 1.1 s for SmolLM2 here)."""
        from gguf import GGMLQuantizationType
        from gguf import quants as gq

        qtype = GGMLQuantizationType(t.ggml_type)
        data = np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        shape = t.torch_shape
        if qtype == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(shape).copy()
        if qtype == GGMLQuantizationType.F16:
            return data.view(np.float16).astype(np.float32).reshape(shape)
        traits = gq._type_traits.get(qtype)
        if traits is None:
            raise GGUFError(f"{self.path}: tensor {t.name!r}: dequantizing {qtype.name} is not implemented")
        traits.init_grid()
        n_rows = int(np.prod(t.shape[1:], dtype=np.int64))          # every dimension after ne0
        rows = data.reshape(n_rows, t.nbytes // n_rows)
        out = np.empty((n_rows, t.shape[0]), dtype=np.float32)
        for r0 in range(0, rows.shape[0], rows_per_call):
            out[r0 : r0 + rows_per_call] = traits.dequantize_rows(rows[r0 : r0 + rows_per_call])
        return out.reshape(shape)

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
