"""Quantized KV formats and the dequantizing paged decode, plain torch (CPU path and triton ground truth).

Formats (all symmetric; scales are stored as fp16, one scale per token per kv head unless stated):
    int8  cache int8 [NB, BS, Hkv, D], scale [NB, BS, Hkv] = absmax / 127, x ~= q * scale
    fp8   cache torch.float8_e4m3fn [NB, BS, Hkv, D], scale [NB, BS, Hkv] = absmax / 448 (e4m3 max normal)
    int4  cache uint8 [NB, BS, Hkv, D // 2], two values per byte (element 2i in the low nibble, 2i+1 in the high),
          stored as value + 8 with value in [-7, 7]; scale [NB, BS, Hkv, D // 32] = group absmax / 7, group size 32
The scale is rounded to fp16 FIRST and the values are quantized with the rounded scale, so dequantization (here, in
the triton kernel, after a snapshot) uses exactly the scale the values were made with. A nonzero absmax never gets
a zero or subnormal fp16 scale (clamped to fp16's smallest normal, 2^-14) nor an infinite one (clamped to 65504).
A zero vector (or group) gets scale 0 and dequantizes to exact zeros. The decode returns LSE in NATURAL LOG.

Rotation (part of the int4 format, ``ROTATED_FORMATS``): K and V are stored as quantize(k @ R), quantize(v @ R),
per kv head, with R = diag(s) H / sqrt(D) [D, D]: H the Sylvester Hadamard matrix, s a fixed +-1 vector
(``rotation_signs``: torch.Generator seeded with ROTATION_SEED). R is orthogonal, so q . k = (q R) . (k R) and
attention over rotated K/V returns o R, un-rotated by R^T (``rotate`` / ``unrotate``). Spreading an outlier channel
over all D channels lets a 32-value int4 group use its 15 levels (QuaRot, SpinQuant).
"""

from __future__ import annotations

import functools

import torch

from modeld_cell.kernels.paged_decode.reference import attend_gathered, check_paged_inputs, gather_blocks

FORMATS = ("int8", "fp8", "int4")
INT4_GROUP = 32
# fp16, not bf16: 11 significant bits instead of 8 for the same 2 bytes, and the clamp below keeps every scale a
# normal fp16 (docs/kernels.md "Quantized KV" has the measured comparison).
SCALE_DTYPE = torch.float16
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
_CACHE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
# Formats whose K/V are stored rotated (module docstring). int8 / fp8 measured no better rotated (docs/kernels.md).
ROTATED_FORMATS = frozenset({"int4"})
ROTATION_SEED = 4


@functools.lru_cache(maxsize=8)
def rotation_signs(D: int) -> torch.Tensor:
    """The fixed +-1 diagonal s [D] fp32 of the rotation R = diag(s) H / sqrt(D) (seeded, so part of the format)."""
    g = torch.Generator().manual_seed(ROTATION_SEED)
    return torch.randint(0, 2, (D,), generator=g).float() * 2 - 1


def rotation_matrix(D: int) -> torch.Tensor:
    """R [D, D] fp64, orthogonal: diag(s) H / sqrt(D) (D a power of 2). For tests and docs; the model rotates with
    ``rotate`` / ``unrotate``, which compute x @ R and y @ R^T without the matrix."""
    if D < 1 or D & (D - 1):
        raise ValueError(f"the Hadamard rotation needs D a power of 2, got D={D}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return rotation_signs(D).double()[:, None] * h / D**0.5


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H / sqrt(D) along the last dim, fp32, by the fast Walsh-Hadamard butterfly. Element-wise adds only: every
    row's bits are independent of the other rows and of the batch shape (the CPU path's chunking invariance), and
    for D = 64 the 1 / 8 normalisation is exact."""
    D = x.shape[-1]
    if D < 1 or D & (D - 1):
        raise ValueError(f"the Hadamard rotation needs D a power of 2, got D={D}")
    y = x.float()
    h = 1
    while h < D:
        y = y.reshape(*x.shape[:-1], D // (2 * h), 2, h)             # pairs (j, j + h) within blocks of 2h
        y = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], -2)
        h *= 2
    return y.reshape(x.shape) * D**-0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ R along the last dim: x [..., D] float -> [..., D] in x's dtype (computed in fp32)."""
    return _hadamard(x.float() * rotation_signs(x.shape[-1]).to(x.device)).to(x.dtype)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """y @ R^T along the last dim (the inverse of ``rotate``): [..., D] -> [..., D] in y's dtype."""
    return (_hadamard(y) * rotation_signs(y.shape[-1]).to(y.device)).to(y.dtype)


def is_rotated(fmt: str | None) -> bool:
    """Whether a format stores rotated K/V (then attention must rotate q and un-rotate its output)."""
    return fmt in ROTATED_FORMATS


def bytes_per_token(fmt: str, layers: int, Hkv: int, D: int) -> int:
    """Bytes of K plus V cache one token costs across all layers, scales included.

    fmt: "bf16" / "fp16" (2 bytes per value), "fp32", "int8" / "fp8" (1 byte per value + one 2-byte scale per head),
    "int4" (half a byte per value + one 2-byte scale per 32 values).
    """
    sb = SCALE_DTYPE.itemsize
    per_head = {
        "fp32": 4 * D,
        "bf16": 2 * D,
        "fp16": 2 * D,
        "int8": D + sb,
        "fp8": D + sb,
        "int4": D // 2 + sb * (D // INT4_GROUP),
    }
    if fmt not in per_head:
        raise ValueError(f"unknown KV format {fmt!r}; known: {sorted(per_head)}")
    if fmt == "int4" and D % INT4_GROUP:
        raise ValueError(f"int4 needs D divisible by {INT4_GROUP}, got D={D}")
    return 2 * layers * Hkv * per_head[fmt]  # 2: K and V


def scale_shape(fmt: str, D: int) -> tuple[int, ...]:
    """Trailing shape of the scales per token per kv head: () for int8 / fp8, (D // 32,) for int4."""
    return (D // INT4_GROUP,) if fmt == "int4" else ()


def value_dim(fmt: str, D: int) -> int:
    """Last dim of the stored values: D, or D // 2 bytes for packed int4."""
    return D // 2 if fmt == "int4" else D


def storage_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax rounded to SCALE_DTYPE; a positive amax is clamped to the dtype's normal range, 0 stays 0."""
    fi = torch.finfo(SCALE_DTYPE)
    s = (amax.float() / qmax).clamp(fi.tiny, fi.max).to(SCALE_DTYPE)
    return torch.where(amax > 0, s, torch.zeros_like(s))


def format_of(cache: torch.Tensor) -> str:
    """The KV format a cache tensor's dtype implies: int8 -> "int8", float8_e4m3fn -> "fp8", uint8 -> "int4"."""
    for fmt, dt in _CACHE_DTYPE.items():
        if cache.dtype == dt:
            return fmt
    raise ValueError(f"no quantized KV format stores {cache.dtype}; expected int8, float8_e4m3fn or uint8 (int4)")


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., D] (any float) along its last dim.

    Returns (q, scale), scale in SCALE_DTYPE: int8/fp8 -> q [..., D], scale [...]; int4 -> q uint8 [..., D // 2],
    scale [..., D // 32]. The values are divided by the ROUNDED scale (see the module docstring).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV format {fmt!r}; known: {FORMATS}")
    if not x.is_floating_point():
        raise ValueError(f"quantize needs a float tensor, got {x.dtype}")
    xf = x.float()
    if fmt == "int4":
        D = x.shape[-1]
        if D % INT4_GROUP:
            raise ValueError(f"int4 needs the last dim divisible by {INT4_GROUP}, got {D}")
        xf = xf.reshape(*x.shape[:-1], D // INT4_GROUP, INT4_GROUP)     # [..., D // 32, 32]
    scale = storage_scale(xf.abs().amax(dim=-1), _QMAX[fmt])           # [...] or [..., D // 32]
    div = torch.where(scale > 0, scale.float(), 1.0).unsqueeze(-1)     # scale 0: the values are all 0
    if fmt == "int4":
        v = (torch.round(xf / div).clamp(-7, 7) + 8).to(torch.uint8).reshape(*x.shape)
        return v[..., 0::2] | (v[..., 1::2] << 4), scale
    if fmt == "int8":
        return torch.round(xf / div).clamp(-127, 127).to(torch.int8), scale
    return (xf / div).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
    """Inverse of quantize: q as stored, scale as stored (any float dtype) -> fp32 [..., D] (D = 2 * q.shape[-1]
    for int4). ``fmt`` defaults to the one q's dtype implies (int8, float8_e4m3fn, uint8 = packed int4)."""
    fmt = fmt or format_of(q)
    if fmt == "int4":
        lo = (q & 0xF).to(torch.int16) - 8
        hi = (q >> 4).to(torch.int16) - 8
        v = torch.stack([lo, hi], dim=-1).reshape(*q.shape[:-1], 2 * q.shape[-1]).float()  # interleave 2i, 2i+1
        vg = v.reshape(*q.shape[:-1], -1, INT4_GROUP)
        return (vg * scale.float().unsqueeze(-1)).reshape(v.shape)
    return q.float() * scale.float().unsqueeze(-1)


def check_quant_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str | None,
    check_tables: bool = True,
):
    """Validate a quantized paged-decode call; returns (fmt, PagedDims)."""
    fmt = fmt or format_of(k_cache)
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV format {fmt!r}; known: {FORMATS}")
    if k_cache.dtype != _CACHE_DTYPE[fmt]:
        raise ValueError(f"format {fmt} stores {_CACHE_DTYPE[fmt]} but k_cache is {k_cache.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    D = q.shape[-1]
    if fmt == "int4" and D % INT4_GROUP:
        raise ValueError(f"int4 needs D divisible by {INT4_GROUP}, got D={D}")
    dims = check_paged_inputs(
        q, k_cache, v_cache, block_tables, seq_lens,
        cache_last_dim=D // 2 if fmt == "int4" else D, check_tables=check_tables,
    )  # fmt: skip
    want = tuple(k_cache.shape[:3]) + ((D // INT4_GROUP,) if fmt == "int4" else ())
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(s.shape) != want or s.dtype != SCALE_DTYPE:
            raise ValueError(f"{name} must be {list(want)} {SCALE_DTYPE} for {fmt}, got {tuple(s.shape)} {s.dtype}")
        if s.device != q.device:
            raise ValueError(f"{name} is on {s.device} but q is on {q.device}")
    return fmt, dims


def quant_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str | None = None,
    sm_scale: float | None = None,
    return_lse: bool = False,
    check_tables: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode over a quantized cache: dequantize the used blocks, then exact fp32 attention.

    Args:
        q: [B, Hq, D] float.  k_cache/v_cache and k_scale/v_scale: as in the module docstring (fmt inferred
        from the cache dtype when None).  block_tables [B, MB] int32, seq_lens [B] int32.
    Returns:
        out [B, Hq, D] q.dtype; with return_lse also lse [B, Hq] fp32, NATURAL LOG (-inf for empty sequences).
    """
    fmt, dims = check_quant_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, fmt, check_tables)
    scale = dims.D**-0.5 if sm_scale is None else float(sm_scale)
    # Only the used blocks are gathered and dequantized, never the whole cache.
    k = dequantize(gather_blocks(k_cache, block_tables, seq_lens), gather_blocks(k_scale, block_tables, seq_lens), fmt)
    v = dequantize(gather_blocks(v_cache, block_tables, seq_lens), gather_blocks(v_scale, block_tables, seq_lens), fmt)
    out, lse = attend_gathered(q, k, v, seq_lens, scale)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
