"""Quantized KV formats and the dequantizing paged decode, plain torch (CPU path and triton ground truth).

Formats (all symmetric, scales fp32, one scale per token per kv head unless stated):
    int8  cache int8 [NB, BS, Hkv, D], scale [NB, BS, Hkv] = absmax / 127, x ~= q * scale
    fp8   cache torch.float8_e4m3fn [NB, BS, Hkv, D], scale [NB, BS, Hkv] = absmax / 448 (e4m3 max normal)
    int4  cache uint8 [NB, BS, Hkv, D // 2], two values per byte (element 2i in the low nibble, 2i+1 in the high),
          stored as value + 8 with value in [-7, 7]; scale [NB, BS, Hkv, D // 32] = group absmax / 7, group size 32
A zero vector (or group) gets scale 0 and dequantizes to exact zeros. The decode returns LSE in NATURAL LOG.
"""

from __future__ import annotations

import torch

from modeld_cell.kernels.paged_decode.reference import attend_gathered, check_paged_inputs, gather_blocks

FORMATS = ("int8", "fp8", "int4")
INT4_GROUP = 32
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
_CACHE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


def bytes_per_token(fmt: str, layers: int, Hkv: int, D: int) -> int:
    """Bytes of K plus V cache one token costs across all layers, scales included.

    fmt: "bf16" / "fp16" (2 bytes per value), "fp32", "int8" / "fp8" (1 byte per value + one fp32 scale per head),
    "int4" (half a byte per value + one fp32 scale per 32 values).
    """
    per_head = {
        "fp32": 4 * D,
        "bf16": 2 * D,
        "fp16": 2 * D,
        "int8": D + 4,
        "fp8": D + 4,
        "int4": D // 2 + 4 * (D // INT4_GROUP),
    }
    if fmt not in per_head:
        raise ValueError(f"unknown KV format {fmt!r}; known: {sorted(per_head)}")
    if fmt == "int4" and D % INT4_GROUP:
        raise ValueError(f"int4 needs D divisible by {INT4_GROUP}, got D={D}")
    return 2 * layers * Hkv * per_head[fmt]  # 2: K and V


def format_of(cache: torch.Tensor) -> str:
    """The KV format a cache tensor's dtype implies: int8 -> "int8", float8_e4m3fn -> "fp8", uint8 -> "int4"."""
    for fmt, dt in _CACHE_DTYPE.items():
        if cache.dtype == dt:
            return fmt
    raise ValueError(f"no quantized KV format stores {cache.dtype}; expected int8, float8_e4m3fn or uint8 (int4)")


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., D] (any float) along its last dim.

    Returns (q, scale): int8/fp8 -> q [..., D], scale [..., ] fp32; int4 -> q uint8 [..., D // 2], scale [..., D // 32].
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
        xg = xf.reshape(*x.shape[:-1], D // INT4_GROUP, INT4_GROUP)
        scale = xg.abs().amax(dim=-1) / _QMAX["int4"]  # [..., D // 32]
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        v = (torch.round(xg * inv.unsqueeze(-1)).clamp(-7, 7) + 8).to(torch.uint8).reshape(*x.shape)
        return v[..., 0::2] | (v[..., 1::2] << 4), scale
    scale = xf.abs().amax(dim=-1) / _QMAX[fmt]  # [...]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)).unsqueeze(-1)
    if fmt == "int8":
        return torch.round(xf * inv).clamp(-127, 127).to(torch.int8), scale
    return (xf * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
    """Inverse of quantize: returns fp32 [..., D] (D = 2 * q.shape[-1] for int4)."""
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
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{name} must be {list(want)} float32 for {fmt}, got {tuple(s.shape)} {s.dtype}")
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
