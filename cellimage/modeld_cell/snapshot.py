"""The snapshot file format (version 2; docs/reuse.md "Snapshot format"): atomic writes, one-read verification.

File: MAGIC(16) | u32 version | u64 header length | header JSON (space-padded so the payload starts 64-byte aligned)
| payload tensors as the header's table lists them | sha256(32) of everything before it. The engine builds the
header (identity, session, payload table) and checks identity and shapes on restore; this module owns the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

SNAPSHOT_MAGIC = b"MODELD-SNAPSHOT\x00"   # 16 bytes
SNAPSHOT_VERSION = 2                      # v2: full cache identity, typed payload table (docs/reuse.md)


class SnapshotError(Exception):
    def __init__(self, msg: str, **details: Any) -> None:
        super().__init__(msg)
        self.details = details


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor without copying (bf16/fp16 through an int16 view, fp8 through uint8: numpy has
    neither)."""
    t = t.contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def buffer_tensor(buf: bytearray, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buf`` (no copy)."""
    n = math.prod(shape)
    if dtype in (torch.bfloat16, torch.float16):
        return torch.frombuffer(buf, dtype=torch.int16, count=n, offset=offset).view(dtype).reshape(shape)
    if dtype == torch.float8_e4m3fn:
        return torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset).view(dtype).reshape(shape)
    return torch.frombuffer(buf, dtype=dtype, count=n, offset=offset).reshape(shape)


def _write_chunk(f: Any, b: Any) -> None:
    f.write(b)


def write_atomic(path: str, parts: Sequence[Any]) -> tuple[int, str]:
    """Write parts + their sha256 to ``path``: tmp file beside it, fsync, os.replace, fsync the directory.
    Returns (bytes, sha256 hex). On any failure the tmp file is removed and ``path`` is untouched."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    h = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                h.update(p)
                _write_chunk(f, p)
                size += memoryview(p).nbytes
            digest = h.digest()
            _write_chunk(f, digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):                 # make the rename durable (not every filesystem allows it)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return size + 32, digest.hex()


def read_snapshot(path: str) -> tuple[dict, bytearray, int]:
    """Read and verify a snapshot file in one go: (header, whole file buffer, payload offset). SnapshotError names
    what is wrong: magic, version, checksum (corrupt or truncated), header."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        got = f.readinto(buf)
    if got != size:
        raise SnapshotError(f"short read ({got} of {size} bytes)")
    head = len(SNAPSHOT_MAGIC) + 12
    if size < head + 32 or not buf.startswith(SNAPSHOT_MAGIC):
        raise SnapshotError("not a modeld snapshot (bad magic or too short)")
    version, hlen = struct.unpack_from("<IQ", buf, len(SNAPSHOT_MAGIC))
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot format version {version}, this worker reads version {SNAPSHOT_VERSION} "
                             "(re-create the snapshot with this worker)", version=version,
                             supported=SNAPSHOT_VERSION)
    mv = memoryview(buf)
    if hashlib.sha256(mv[:-32]).digest() != bytes(mv[-32:]):
        raise SnapshotError("checksum mismatch: the file is corrupt or truncated")
    if head + hlen > size - 32:
        raise SnapshotError("header length points past the end of the file")
    try:
        header = json.loads(bytes(mv[head : head + hlen]))
    except ValueError as e:
        raise SnapshotError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise SnapshotError("header is not a JSON object")
    return header, buf, head + hlen
