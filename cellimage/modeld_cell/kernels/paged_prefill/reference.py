"""Paged prefill attention, the torch reference: T new query rows at positions past..past+T-1 attend causally to
the session's first past+T cached tokens (the new tokens' K/V already written), read through its block table.

Plain torch in fp32: gather the blocks, dequantize an int8 / fp8 cache with its per-token-per-head scales, expand
the KV heads to the query heads (GQA), mask key j > past + i, softmax. It is the ground truth of triton.py.
"""

from __future__ import annotations

import torch


def check_prefill_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                         past: int, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> tuple[int, int, int, int, int, int]:
    """Shapes and dtypes; returns (T, Hq, Hkv, G, D, BS). Raises ValueError naming the argument."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    T, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache / v_cache must both be [NB, BS, Hkv, D], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    _, BS, Hkv, Dk = k_cache.shape
    if Dk != D:
        raise ValueError(f"cache head dim {Dk} != q head dim {D} (packed int4 caches are not read here)")
    if Hq % Hkv:
        raise ValueError(f"Hq {Hq} must be a multiple of Hkv {Hkv}")
    if block_table.dim() != 1 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be [MB] int32, got {tuple(block_table.shape)} {block_table.dtype}")
    if past < 0 or block_table.shape[0] * BS < past + T:
        raise ValueError(f"block_table of {block_table.shape[0]} blocks of {BS} does not cover past {past} + T {T}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together")
    if k_scale is not None and (k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]):
        raise ValueError(f"scales must be [NB, BS, Hkv] = {tuple(k_cache.shape[:3])}, got {tuple(k_scale.shape)}")
    if k_scale is None and k_cache.dtype != q.dtype:
        raise ValueError(f"an unquantized cache ({k_cache.dtype}) must have q's dtype ({q.dtype})")
    return T, Hq, Hkv, Hq // Hkv, D, BS


def gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of a paged cache: [NB, BS, ...] -> [n, ...] (a copy)."""
    bs = cache.shape[1]
    nblk = -(-n // bs)
    return cache.index_select(0, block_table[:nblk].long()).reshape(-1, *cache.shape[2:])[:n]


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  past: int, sm_scale: float | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D] in q's dtype, or int8 / float8_e4m3fn with k_scale,
    v_scale [NB, BS, Hkv] (value = stored * scale); block_table: [MB] int32 covering past + T tokens.
    Returns [T, Hq, D] in q's dtype."""
    T, Hq, Hkv, G, D, _ = check_prefill_inputs(q, k_cache, v_cache, block_table, past, k_scale, v_scale)
    n = past + T
    k, v = gather(k_cache, block_table, n).float(), gather(v_cache, block_table, n).float()   # [n, Hkv, D]
    if k_scale is not None and v_scale is not None:
        k = k * gather(k_scale, block_table, n).float().unsqueeze(-1)
        v = v * gather(v_scale, block_table, n).float().unsqueeze(-1)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)                              # [n, Hq, D]
    scale = D**-0.5 if sm_scale is None else sm_scale
    s = torch.einsum("thd,nhd->htn", q.float(), k) * scale                                   # [Hq, T, n]
    visible = torch.arange(n, device=q.device)[None, :] <= (past + torch.arange(T, device=q.device))[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v).to(q.dtype)
