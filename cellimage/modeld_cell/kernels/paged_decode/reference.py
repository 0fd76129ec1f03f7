"""Paged decode attention with GQA, plain torch: the CPU production path and the triton kernel's ground truth.

Layout (vLLM "NHD", shared with the worker's KV cache):
    k_cache, v_cache: [NB, BS, Hkv, D]    NB physical blocks of BS token slots
    block_tables:     [B, MB] int32       logical block j of sequence b lives in physical block block_tables[b, j]
    seq_lens:         [B] int32           tokens of sequence b are logical positions 0 .. seq_lens[b]-1
    q:                [B, Hq, D]          one decode query per sequence, Hq = G * Hkv
Query head h reads kv head h // G (heads of a group are consecutive, as with repeat_interleave).
Returns out [B, Hq, D] in q.dtype and lse [B, Hq] fp32, NATURAL-LOG log-sum-exp of the scaled scores.
A sequence of length 0 gives out 0 and lse -inf. Entries of block_tables past a sequence's last used block are
ignored (they may hold anything, e.g. -1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PagedDims(NamedTuple):
    B: int  # sequences
    Hq: int  # query heads
    Hkv: int  # kv heads
    G: int  # query heads per kv head
    D: int  # head dim
    NB: int  # physical blocks in the cache
    BS: int  # token slots per block
    MB: int  # block-table width (max blocks per sequence)


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cache_last_dim: int | None = None,
    check_tables: bool = True,
) -> PagedDims:
    """Validate a paged-decode call and return its dims; raise ValueError with the offending shapes otherwise.

    cache_last_dim: the cache's last dim when it is not D (packed int4 stores D // 2 bytes).
    check_tables: also check seq_lens and the used block-table entries against the cache. This reads device
    memory (a host sync on CUDA), so a CUDA-graph hot path that already trusts its tables passes False.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"q must be floating point, got {q.dtype}")
    B, Hq, D = q.shape
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, BLOCK_SIZE, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)}/{v_cache.dtype} must match k_cache {tuple(k_cache.shape)}/{k_cache.dtype}"
        )
    NB, BS, Hkv, last = k_cache.shape
    want_last = D if cache_last_dim is None else cache_last_dim
    if last != want_last:
        raise ValueError(f"cache last dim is {last} but q has D={D} (expected cache last dim {want_last})")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a positive multiple of Hkv={Hkv} (GQA)")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, max_blocks_per_seq], got shape {tuple(block_tables.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [B={B}] int32, got shape {tuple(seq_lens.shape)} {seq_lens.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    MB = block_tables.shape[1]
    if check_tables and B > 0:
        if bool((seq_lens < 0).any()) or bool((seq_lens > MB * BS).any()):
            raise ValueError(
                f"seq_lens must lie in [0, max_blocks_per_seq * BLOCK_SIZE = {MB * BS}], got {seq_lens.tolist()}"
            )
        used = torch.arange(MB, device=q.device)[None, :] < ((seq_lens + BS - 1) // BS)[:, None]  # [B, MB]
        bad = used & ((block_tables < 0) | (block_tables >= NB))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is out of range [0, {NB}) "
                f"for a used block (seq_lens[{b}] = {int(seq_lens[b])}, BLOCK_SIZE = {BS})"
            )
    return PagedDims(B, Hq, Hkv, Hq // Hkv, D, NB, BS, MB)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Gather each sequence's used blocks: cache [NB, BS, ...] -> [B, L, ...], L = BS * max used blocks.

    Positions at or past seq_lens[b] hold whatever the gathered block holds; callers mask them. A single sequence
    whose blocks are consecutive in the cache is returned as a view (no copy), the common CPU decode case.
    """
    BS = cache.shape[1]
    n_blk = int((int(seq_lens.max()) + BS - 1) // BS) if seq_lens.numel() else 0
    bt = block_tables[:, :n_blk].long()  # [B, n_blk]
    if bt.shape[0] == 1 and n_blk > 0:
        first = int(bt[0, 0])
        if torch.equal(bt[0], torch.arange(first, first + n_blk, device=bt.device)):
            return cache[first : first + n_blk].reshape(1, n_blk * BS, *cache.shape[2:])
    used = torch.arange(n_blk, device=bt.device)[None, :] < ((seq_lens.long() + BS - 1) // BS)[:, None]
    bt = torch.where(used, bt, torch.zeros_like(bt))  # unused entries may be -1: point them at block 0
    g = cache.index_select(0, bt.flatten())  # [B * n_blk, BS, ...]
    return g.reshape(bt.shape[0], n_blk * BS, *cache.shape[2:])


def attend_gathered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GQA decode attention over gathered keys, fp32 math.

    q [B, Hq, D]; k, v [B, L, Hkv, D] (any float dtype); seq_lens [B]. Returns out [B, Hq, D] fp32, lse [B, Hq] fp32.
    """
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, D)
    s = torch.einsum("bhgd,blhd->bhgl", qg, k.float()) * sm_scale  # [B, Hkv, G, L]
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens.long()[:, None]  # [B, L]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True) if L > 0 else torch.full((B, Hkv, G, 1), float("-inf"), device=q.device)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty sequence: avoid -inf - -inf
    p = torch.exp(s - m_safe)
    d = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgl,blhd->bhgd", p, v.float()) / torch.where(d > 0, d, torch.ones_like(d))
    lse = (m_safe + torch.log(d)).squeeze(-1)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def attend_gathered_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """attend_gathered without the LSE, through torch SDPA (fused, fp32 accumulation; 2-3x faster on CPU).

    q [B, Hq, D]; k, v [B, L, Hkv, D] in q.dtype; returns out [B, Hq, D] in q.dtype.
    """
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    if L == 0:
        return torch.zeros_like(q)
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens.long()[:, None]  # [B, L]
    mask = None if bool(valid.all()) else valid[:, None, None, :]  # masks cost time: skip when all lengths are L
    out = F.scaled_dot_product_attention(
        q.reshape(B, Hkv, Hq // Hkv, D), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=sm_scale
    )  # [B, Hkv, G, D]
    out = out.reshape(B, Hq, D)
    # An empty sequence: SDPA gives 0 or NaN for an all-masked row depending on the torch version; contract says 0.
    return torch.where((seq_lens > 0)[:, None, None], out, torch.zeros_like(out))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    return_lse: bool = False,
    check_tables: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode attention (layout in the module docstring).

    Args:
        q: [B, Hq, D] fp32/bf16/fp16.
        k_cache, v_cache: [NB, BS, Hkv, D], float dtype.
        block_tables: [B, MB] int32.  seq_lens: [B] int32.
        sm_scale: score scale, default D ** -0.5.
    Returns:
        out [B, Hq, D] in q.dtype, and with return_lse also lse [B, Hq] fp32 (natural log, -inf for empty sequences).
    """
    dims = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, check_tables=check_tables)
    scale = dims.D**-0.5 if sm_scale is None else float(sm_scale)
    k = gather_blocks(k_cache, block_tables, seq_lens)
    v = gather_blocks(v_cache, block_tables, seq_lens)
    if not return_lse and k.dtype == q.dtype:
        return attend_gathered_sdpa(q, k, v, seq_lens, scale)
    out, lse = attend_gathered(q, k, v, seq_lens, scale)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
