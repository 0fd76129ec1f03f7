"""Block-sparse causal prefill attention, plain torch: the CPU path and the triton kernel's ground truth.

One sequence at a time, possibly after cached tokens. q [T, H, D] holds the queries at absolute positions
q0..q0+T-1; k and v [S, Hkv, D] hold every key they may see, positions 0..S-1 with S = q0 + T (the past, then the
new tokens). q0 = S - T is implied by the shapes (flash-attention's bottom-right causal alignment); S == T is an
ordinary prefill. H = G * Hkv: query head h reads kv head h // G.

Block geometry: queries and keys are cut at the same absolute multiples of ``block_size`` (bs). Key block kb holds
keys [kb*bs, (kb+1)*bs), nKB = ceil(S / bs). The queries fall in absolute blocks qb0..nKB-1, qb0 = q0 // bs, so
nQB = nKB - qb0 (0 when T == 0). A block mask [H, nQB, nKB] bool is bottom-right aligned: row r is absolute query
block qb0 + r (qb0 = nKB - nQB is read off its shape); with no past it is the square [H, nB, nB]. When q0 is not a
multiple of bs the first query block is partial: its rows before q0 are past tokens, neither computed nor written,
and per-row causal masking handles the rest. The attention is exact for the mask: causal softmax over the kept keys
only; key blocks right of a query block's diagonal are ignored (causality wins); a row that keeps no key returns 0.
``masked_dense_attention`` is the obviously-correct oracle (dense cost); ``block_sparse_attention`` touches only the
kept blocks and is the CPU production path (CPU flash attention, merged by LSE); ``block_sparse_gather_attention`` is
the portable fp32 form of it.

The pattern estimate follows MInference's "vertical-slash" idea: the last query block's attention to every key
(past included) shows which key columns (vertical) and which diagonals (slash) carry the mass; every query block
then keeps the sink block, its local blocks, and the top vertical blocks and diagonals among those the sink and
local blocks do not already cover.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from modeld_cell.kernels.merge.reference import merge_states

# CPU flash attention that also returns the natural-log LSE (torch >= 2.3): block_sparse_attention's building block.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

DENSE_BELOW_TOKENS = 4096  # keys (past + new) below this: a dense flash kernel beats the sparse bookkeeping
DENSE_ABOVE_DENSITY = 0.6  # above this fraction of causal blocks, sparse saves too little
# New query rows below this run dense whatever the past: the estimate alone scores 64 rows against every key, a
# quarter of the dense work at 256 rows and half of it at 128.
DENSE_BELOW_QUERIES = 256
# Vertical blocks and diagonals each keep at most this many tokens' worth (MInference-style fixed budgets: it keeps
# 1,000 vertical and 6,096 slash tokens at 128k), so the kept fraction, and the work, falls as the context grows.
# At block 64 that is 16 blocks, above keep_ratio 0.1's 13 at 8k: below ~10k tokens the ratio decides alone.
MAX_KEEP_TOKENS = 1024


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q [T, H, D], k/v [S, Hkv, D] with S >= T (q0 = S - T cached tokens first); return (T, H, Hkv, D)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    T, H, D = q.shape
    if k.shape[0] < T or k.shape[2] != D:
        raise ValueError(f"k/v {tuple(k.shape)} must be [S >= T={T}, Hkv, D={D}] (past keys first, then the new ones)")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"H={H} must be a positive multiple of Hkv={Hkv} (GQA)")
    if not (q.is_floating_point() and q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    return T, H, Hkv, D


def block_grid(T: int, S: int, block_size: int) -> tuple[int, int, int]:
    """(qb0, nQB, nKB) for T queries that are the last T of S positions: key blocks 0..nKB-1, query blocks
    qb0..qb0+nQB-1 (absolute, nQB = nKB - qb0, or 0 when T == 0)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    nKB = (S + block_size - 1) // block_size
    qb0 = (S - T) // block_size
    return qb0, (nKB - qb0 if T else 0), nKB


def check_block_mask(block_mask: torch.Tensor, H: int, T: int, block_size: int, S: int | None = None) -> int:
    """Validate block_mask [H, nQB, nKB] bool for T queries over S keys (default S = T); return nQB."""
    S = T if S is None else S
    _, nQB, nKB = block_grid(T, S, block_size)
    if block_mask.dtype != torch.bool or tuple(block_mask.shape) != (H, nQB, nKB):
        raise ValueError(
            f"block_mask must be bool [H={H}, nQB={nQB}, nKB={nKB}] for T={T} queries over S={S} keys, "
            f"block_size={block_size}; got {tuple(block_mask.shape)} {block_mask.dtype}"
        )
    return nQB


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None, max_chunk_elems: int = 1 << 25
) -> torch.Tensor:
    """Dense causal attention via torch SDPA. q [T, H, D], k/v [S, Hkv, D] -> out [T, H, D] in q.dtype.

    With a past (S > T) query rows are chunked so the bool mask stays under max_chunk_elems elements.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    S = k.shape[0]
    q0 = S - T
    if T == 0:
        return torch.empty_like(q)
    # 4-D [1, H, T, D] / [1, Hkv, S, D]: CUDA's flash and memory-efficient SDPA kernels take only 4-D inputs; 3-D ones
    # fall back to the math kernel, which materializes [H, T, S] scores (out of memory at 32k+)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q0 == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=sm_scale, enable_gqa=Hkv != H)
        return out[0].transpose(0, 1).contiguous()
    out = torch.empty_like(q)
    rows = max(1, max_chunk_elems // S)
    for r0 in range(0, T, rows):  # loop over chunks of query rows, not tokens
        r1 = min(T, r0 + rows)
        n = q0 + r1  # keys the chunk can see
        mask = torch.ones(r1 - r0, n, dtype=torch.bool, device=q.device).tril(q0 + r0)  # key j <= q0 + r0 + i
        o = F.scaled_dot_product_attention(qh[:, :, r0:r1], kh[:, :, :n], vh[:, :, :n], attn_mask=mask,
                                           scale=sm_scale, enable_gqa=Hkv != H)  # [1, H, rows, D]  # fmt: skip
        out[r0:r1] = o[0].transpose(0, 1)
    return out


def masked_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int = 64,
    sm_scale: float | None = None,
    max_chunk_elems: int = 1 << 25,
) -> torch.Tensor:
    """Causal attention restricted to the kept blocks as masked dense attention: fp32 math, exact for the mask.

    The obviously-correct oracle: it scores every causal (query, key) pair and masks, so it costs as much as dense.
    block_sparse_attention below computes the same thing while skipping dropped blocks.

    Args:
        q: [T, H, D] float at positions S-T..S-1; k, v: [S, Hkv, D] same dtype.
        block_mask: [H, nQB, nKB] bool (module docstring); entries right of the diagonal are ignored.
        max_chunk_elems: bound on the fp32 score elements materialised at once (query rows are chunked).
    Returns:
        out [T, H, D] in q.dtype; rows with no kept key are 0.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    S = k.shape[0]
    check_block_mask(block_mask, H, T, block_size, S)
    G, q0 = H // Hkv, S - T
    qb0 = q0 // block_size
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    out = torch.empty_like(q)
    if T == 0:
        return out
    kf = k.float().permute(1, 0, 2)  # [Hkv, S, D]
    vf = v.float().permute(1, 0, 2)
    kpos = torch.arange(S, device=q.device)
    rows_per_chunk = max(1, max_chunk_elems // max(H * S, 1))
    for r0 in range(0, T, rows_per_chunk):  # loop over chunks of query rows, not tokens
        r1 = min(T, r0 + rows_per_chunk)
        n = q0 + r1  # keys the chunk can see
        pos = torch.arange(q0 + r0, q0 + r1, device=q.device)  # absolute query positions [rows]
        qc = q[r0:r1].float().permute(1, 0, 2).reshape(Hkv, G * (r1 - r0), D)  # [Hkv, G*rows, D]
        s = torch.bmm(qc, kf[:, :n].transpose(1, 2)).reshape(H, r1 - r0, n) * scale  # [H, rows, keys]
        keep = block_mask[:, pos // block_size - qb0][:, :, kpos[:n] // block_size]  # [H, rows, keys]
        keep = keep & (pos[None, :, None] >= kpos[None, None, :n])  # causal
        s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no kept key
        p = torch.exp(s - m)
        d = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(d > 0, d, torch.ones_like(d))
        o = torch.bmm(p.reshape(Hkv, G * (r1 - r0), n), vf[:, :n])  # [Hkv, G*rows, D]
        out[r0:r1] = o.reshape(H, r1 - r0, D).permute(1, 0, 2).to(q.dtype)
    return out


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int = 64,
    sm_scale: float | None = None,
    max_chunk_elems: int = 1 << 24,
) -> torch.Tensor:
    """Block-sparse causal attention that only touches kept blocks: the CPU production path.

    Built from CPU flash attention, which returns each row's natural-log LSE, in the inputs' dtype (bf16 in a bf16
    cell, as the dense path computes): per query block, (a) its diagonal key block under a causal mask, all query
    blocks in one batched call, and (b) its other kept key blocks, gathered per (query block, head) pair, pairs
    sorted by kept count and chunked, padding slots masked; then (a) and (b) merge exactly by their LSEs. The work
    is the kept blocks plus a little padding. Same contract as masked_dense_attention: exact for the mask (a dropped
    diagonal block is dropped too), rows with no kept key are 0. Without CPU flash attention (torch < 2.3) or off the
    CPU it is block_sparse_gather_attention.

    Args:
        q: [T, H, D] float at positions S-T..S-1; k, v: [S, Hkv, D] same dtype.
        block_mask: [H, nQB, nKB] bool (module docstring); entries right of the diagonal are ignored.
        max_chunk_elems: bound on the gathered K elements per call ((query block, head) pairs are chunked).
    Returns:
        out [T, H, D] in q.dtype.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    S = k.shape[0]
    nQB = check_block_mask(block_mask, H, T, block_size, S)
    if _FLASH_CPU is None or q.device.type != "cpu":
        return block_sparse_gather_attention(q, k, v, block_mask, block_size, sm_scale)
    if T == 0:
        return torch.empty_like(q)
    G, bs, dt, dev = H // Hkv, block_size, q.dtype, q.device
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    qb0, _, nKB = block_grid(T, S, bs)
    lead = S - T - qb0 * bs  # past rows in the first query block (0 when q0 is a multiple of bs)
    # [T, H, D] -> [nQB, H, bs, D]; [S, Hkv, D] -> [Hkv, nKB, bs, D], zero-padded to whole blocks
    qb = F.pad(q, (0, 0, 0, 0, lead, nQB * bs - lead - T)).reshape(nQB, bs, H, D).transpose(1, 2).contiguous()
    kb = F.pad(k, (0, 0, 0, 0, 0, nKB * bs - S)).reshape(nKB, bs, Hkv, D).permute(2, 0, 1, 3).contiguous()
    vb = F.pad(v, (0, 0, 0, 0, 0, nKB * bs - S)).reshape(nKB, bs, Hkv, D).permute(2, 0, 1, 3).contiguous()
    keep = block_mask & _causal_blocks(nQB, nKB, dev)
    rows = torch.arange(nQB, device=dev)
    has_diag = keep[:, rows, qb0 + rows].t()  # [nQB, H]
    keep[:, rows, qb0 + rows] = False  # what is left lies strictly before each query block: no causal mask needed

    # (a) diagonal blocks, every query block at once; a KV head's G query heads stacked along the rows
    causal = torch.ones(bs, bs, dtype=torch.bool, device=dev).tril()
    dmask = torch.zeros(bs, bs, dtype=dt, device=dev).masked_fill_(~causal, -math.inf).repeat(G, 1)[None, None]
    o1, l1 = _FLASH_CPU(qb.view(nQB, Hkv, G * bs, D), kb[:, qb0:].transpose(0, 1), vb[:, qb0:].transpose(0, 1),
                        attn_mask=dmask, scale=scale)[:2]  # fmt: skip
    P = nQB * H  # (query block, head) pairs, query-block major
    o1, l1 = o1.reshape(P, bs, D), l1.reshape(P, bs).masked_fill(~has_diag.reshape(P, 1), -math.inf)
    out = torch.where(torch.isfinite(l1)[..., None], o1, 0.0).to(dt)  # pairs with nothing off the diagonal

    # (b) the other kept blocks, gathered per (query block, head) pair; pairs sorted by kept count and cut into
    # chunks, so a chunk pads each pair only to its widest neighbour (padding slots are masked)
    kv_idx, kv_cnt = mask_to_kv_indices(keep)
    kv_idx, kv_cnt = kv_idx.long().transpose(0, 1), kv_cnt.long().t()  # [nQB, H, K], [nQB, H]
    flat = (kv_idx + (torch.arange(H, device=dev) // G * nKB)[None, :, None]).reshape(P, -1)  # rows of kflat
    cnt_all = kv_cnt.reshape(P)
    kflat, vflat = kb.view(Hkv * nKB, bs * D), vb.view(Hkv * nKB, bs * D)
    qp = qb.view(P, 1, bs, D)
    counts, order = torch.sort(cnt_all, stable=True)
    counts_l = counts.tolist()
    i = next((n for n, c in enumerate(counts_l) if c > 0), P)
    while i < P:
        j = i + 1
        while j < P and (j - i + 1) * counts_l[j] * bs * D <= max_chunk_elems:
            j += 1
        K = counts_l[j - 1]  # the chunk's widest pair (ascending order)
        sel = order[i:j]
        i = j
        cnt = cnt_all[sel]  # [C]
        pad = torch.arange(K, device=dev) >= cnt[:, None]  # [C, K] padding slots
        rows_k = flat[sel, :K].masked_fill(pad, 0).flatten()
        kg = kflat.index_select(0, rows_k).view(len(sel), 1, K * bs, D)
        vg = vflat.index_select(0, rows_k).view(len(sel), 1, K * bs, D)
        pm = None
        if bool(pad.any()):
            pm = torch.zeros(pad.shape, dtype=dt, device=dev).masked_fill_(pad, -math.inf)
            pm = pm.repeat_interleave(bs, -1)[:, None, None].expand(-1, 1, bs, -1)  # [C, 1, bs (broadcast), K*bs]
        o2, l2 = _FLASH_CPU(qp[sel], kg, vg, attn_mask=pm, scale=scale)[:2]
        # every pair here keeps at least one block, so its LSE is real; a dropped diagonal (LSE -inf) weighs nothing
        out[sel] = merge_states(o1[sel], l1[sel], o2[:, 0], l2[:, 0])[0]
    return out.view(nQB, H, bs, D).transpose(1, 2).reshape(nQB * bs, H, D)[lead : lead + T]


def block_sparse_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int = 64,
    sm_scale: float | None = None,
    max_chunk_elems: int = 1 << 21,
) -> torch.Tensor:
    """Block-sparse causal attention that only touches kept blocks, fp32 math: the portable path (any device, any
    torch) and block_sparse_attention's fallback where CPU flash attention is missing.

    Each query block gathers its kept key blocks (padded to the chunk's largest count and masked), so the work is
    proportional to the kept blocks. Small chunks (the default 2M elements, measured on a 2-core CPU) keep the
    gathered K/V in cache and the padding low. Same contract and result as masked_dense_attention.

    Args:
        q: [T, H, D] float at positions S-T..S-1; k, v: [S, Hkv, D] same dtype.
        block_mask: [H, nQB, nKB] bool (module docstring); entries right of the diagonal are ignored.
        max_chunk_elems: bound on the fp32 elements gathered / scored at once (query blocks are chunked).
    Returns:
        out [T, H, D] in q.dtype; rows with no kept key are 0.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    S = k.shape[0]
    nQB = check_block_mask(block_mask, H, T, block_size, S)
    G, bs = H // Hkv, block_size
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    if T == 0:
        return torch.empty_like(q)
    qb0, _, nKB = block_grid(T, S, bs)
    lead = S - T - qb0 * bs  # past rows in the first query block (0 when q0 is a multiple of bs)
    # [T, h, D] -> [h, nQB, bs, D] and [S, hkv, D] -> [hkv, nKB, bs, D], fp32, zero-padded to whole blocks
    qb = F.pad(q.float(), (0, 0, 0, 0, lead, nQB * bs - lead - T)).reshape(nQB, bs, H, D).permute(2, 0, 1, 3)
    kb = F.pad(k.float(), (0, 0, 0, 0, 0, nKB * bs - S)).reshape(nKB, bs, Hkv, D).permute(2, 0, 1, 3)
    vb = F.pad(v.float(), (0, 0, 0, 0, 0, nKB * bs - S)).reshape(nKB, bs, Hkv, D).permute(2, 0, 1, 3)
    kv_idx, kv_cnt = mask_to_kv_indices(block_mask)  # [H, nQB, K], [H, nQB]
    kv_idx, kv_cnt = kv_idx.long(), kv_cnt.long()
    head_kv = (torch.arange(H, device=q.device) // G)[:, None, None]  # [H, 1, 1]
    within = torch.arange(bs, device=q.device)
    out = torch.empty(H, nQB, bs, D, device=q.device)
    per_qblock = H * kv_idx.shape[-1] * bs * max(D, bs)
    C = max(1, max_chunk_elems // max(per_qblock, 1))  # query blocks per chunk
    for c0 in range(0, nQB, C):  # loop over chunks of query blocks, not tokens
        c1 = min(nQB, c0 + C)
        cnt = kv_cnt[:, c0:c1]  # [H, Cc]
        K = max(int(cnt.max()), 1)
        idx = kv_idx[:, c0:c1, :K]  # [H, Cc, K]
        kg = kb[head_kv, idx].flatten(2, 3)  # [H, Cc, K*bs, D]
        vg = vb[head_kv, idx].flatten(2, 3)
        kpos = (idx[..., None] * bs + within).flatten(2)  # [H, Cc, K*bs] key positions
        slot_ok = (torch.arange(K, device=q.device) < cnt[..., None]).repeat_interleave(bs, -1)  # padding slots
        qpos = ((qb0 + torch.arange(c0, c1, device=q.device))[:, None] * bs + within)[None, :, :, None]  # [1,Cc,bs,1]
        keep = (slot_ok & (kpos < S))[:, :, None, :] & (kpos[:, :, None, :] <= qpos)  # [H, Cc, bs, K*bs]
        # SDPA with a bool mask is exact for the mask and fuses the softmax (no [.., K*bs] fp32 scores kept).
        o = F.scaled_dot_product_attention(qb[:, c0:c1], kg, vg, attn_mask=keep, scale=scale)
        # A row with no kept key: SDPA gives 0 or NaN depending on the torch version; the contract says 0.
        out[:, c0:c1] = torch.where(keep.any(-1, keepdim=True), o, 0.0)
    return out.permute(1, 2, 0, 3).reshape(nQB * bs, H, D)[lead : lead + T].to(q.dtype)


def causal_block_count(nB: int) -> int:
    """Blocks on or below the diagonal of an nB x nB block grid."""
    return nB * (nB + 1) // 2


def _causal_blocks(nQB: int, nKB: int, device: torch.device) -> torch.Tensor:
    """[nQB, nKB] bool: key blocks on or left of each query block's diagonal (bottom-right aligned grid)."""
    return torch.ones(nQB, nKB, dtype=torch.bool, device=device).tril(nKB - nQB)


def block_density(block_mask: torch.Tensor) -> float:
    """Fraction of causal blocks kept, over all heads; block_mask [H, nQB, nKB] (bottom-right aligned)."""
    H, nQB, nKB = block_mask.shape
    causal = _causal_blocks(nQB, nKB, block_mask.device)
    return float((block_mask & causal).sum()) / max(H * int(causal.sum()), 1)


def estimate_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int = 64,
    keep_ratio: float = 0.1,
    vertical_topk: int | None = None,
    slash_topk: int | None = None,
    local_blocks: int = 2,
    last_q: int | None = None,
    sm_scale: float | None = None,
    dense_last_block: bool = True,
    max_keep_tokens: int | None = MAX_KEEP_TOKENS,
) -> torch.Tensor:
    """Cheap online vertical-slash block pattern from the last queries' attention to every key, past included.

    Args:
        q: [T, H, D] at positions S-T..S-1; k: [S, Hkv, D].
        keep_ratio: fraction of the nKB key blocks chosen as vertical blocks and as diagonal offsets (each), at most
            ``max_keep_tokens // block_size`` of each (None: no cap); vertical_topk / slash_topk override the counts.
        local_blocks: most recent key blocks always kept per query block (the diagonal counts as one).
        last_q: how many final query rows to score (default block_size).
        dense_last_block: the last query block keeps every key block. It is one row of the grid (at most 2/nQB of
            the dense work), the estimate has just scored it against every key, and it makes the next-token logits
            and the prompt's final K/V (where a question about the context sits); vertical-slash alone drops the
            pass-key block there in 124 of SmolLM2's 270 (layer, head) pairs on quality.passkey_prompt(14), and the
            key is not retrieved (docs/kernels.md, "Profiles in the worker").
    Returns:
        block_mask [H, nQB, nKB] bool, causal, always holding the sink block (key block 0) and the local blocks.
        The top-k picks skip what those already hold: key block 0 and the last ``local_blocks`` key blocks (local
        or in the future for every query block), and diagonals within ``local_blocks - 1`` blocks of the main one
        (both key blocks they cross are local); the sink block's mass does not count towards the diagonals.
        Otherwise the top vertical is nearly always the sink, the top diagonals the main one and the sink's own
        (offset = query position), and the picks add nothing.
    """
    T, H, Hkv, D = check_qkv(q, k, k)
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    S = k.shape[0]
    G = H // Hkv
    qb0, nQB, nKB = block_grid(T, S, block_size)
    dev = q.device
    if T == 0:
        return torch.zeros(H, 0, nKB, dtype=torch.bool, device=dev)
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    if max_keep_tokens is not None and max_keep_tokens < block_size:
        raise ValueError(f"max_keep_tokens must be at least block_size={block_size}, got {max_keep_tokens}")
    n_keep = max(1, math.ceil(keep_ratio * nKB))
    if max_keep_tokens is not None:
        n_keep = min(n_keep, max_keep_tokens // block_size)
    n_v = vertical_topk if vertical_topk is not None else n_keep
    n_s = slash_topk if slash_topk is not None else n_keep
    Lq = min(last_q or block_size, T)
    qpos = torch.arange(S - Lq, S, device=dev)  # absolute positions of the scored queries [Lq]
    kpos = torch.arange(S, device=dev)
    causal = kpos[None, :] <= qpos[:, None]  # [Lq, S]
    offset = (qpos[:, None] - kpos[None, :]).clamp(min=0).expand(G, Lq, S).reshape(G, Lq * S)  # diagonal index
    vert = torch.zeros(H, nKB * block_size, device=dev)  # attention mass per key column
    slash = torch.zeros(H, nKB * block_size, device=dev)  # attention mass per diagonal offset (query - key)
    for hk in range(Hkv):  # per kv head bounds memory at [G, Lq, S]
        qh = q[T - Lq :, hk * G : (hk + 1) * G].float().transpose(0, 1)  # [G, Lq, D]
        s = torch.matmul(qh, k[:, hk].float().t()) * scale  # [G, Lq, S]
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        vert[hk * G : (hk + 1) * G, :S] = a.sum(dim=1)
        a[:, :, :block_size] = 0  # the sink block is always kept: its mass must not vote for the far diagonals
        slash[hk * G : (hk + 1) * G].scatter_add_(1, offset, a.reshape(G, Lq * S))  # masked entries add 0
    vert_blk = vert.reshape(H, nKB, block_size).sum(-1)  # [H, nKB] per key block
    slash_blk = slash.reshape(H, nKB, block_size).sum(-1)  # [H, nKB] per diagonal block offset

    qb = (qb0 + torch.arange(nQB, device=dev))[:, None]  # absolute query blocks
    kb = torch.arange(nKB, device=dev)[None, :]
    diff = qb - kb  # [nQB, nKB] block offset of (query block, key block)
    mask = ((kb == 0) | ((diff >= 0) & (diff < local_blocks))).expand(H, nQB, nKB).clone()  # sink + local
    blk = torch.arange(nKB, device=dev)
    v_cand = (blk > 0) & (blk < nKB - local_blocks)  # vertical blocks the sink / local blocks do not hold
    s_cand = blk >= local_blocks - 1  # diagonals crossing a key block that is not local
    n_v, n_s = min(max(n_v, 0), int(v_cand.sum())), min(max(n_s, 0), int(s_cand.sum()))
    if n_v:
        vsel = torch.zeros(H, nKB, dtype=torch.bool, device=dev)
        vsel.scatter_(1, vert_blk.masked_fill(~v_cand, -1.0).topk(n_v, dim=1).indices, True)
        mask |= vsel[:, None, :]
    if n_s:
        ssel = torch.zeros(H, nKB + 1, dtype=torch.bool, device=dev)  # one spare slot for diff - 1 < 0
        ssel.scatter_(1, slash_blk.masked_fill(~s_cand, -1.0).topk(n_s, dim=1).indices, True)
        # A token diagonal with offset in block ob crosses key blocks qb - ob and qb - ob - 1 of query block qb.
        d0 = diff.clamp(0, nKB)
        d1 = (diff - 1).clamp(0, nKB)
        mask |= ssel[:, d0] | (ssel[:, d1] & (diff >= 1))
    if dense_last_block:
        mask[:, -1] = True
    return mask & (diff >= 0)


def choose_path(
    T: int,
    density: float | None = None,
    min_tokens: int = DENSE_BELOW_TOKENS,
    max_density: float = DENSE_ABOVE_DENSITY,
    past: int = 0,
    min_queries: int = DENSE_BELOW_QUERIES,
) -> str:
    """ "dense" when the keys are few (past + T < min_tokens), the new rows are few (T < min_queries) or the mask is
    dense-ish (density > max_density); else "sparse"."""
    if past + T < min_tokens or T < min_queries or (density is not None and density > max_density):
        return "dense"
    return "sparse"


def mask_to_kv_indices(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept causal key blocks per (head, query block), ascending: the triton kernel's iteration lists.

    block_mask [H, nQB, nKB] bool (bottom-right aligned) -> kv_idx [H, nQB, K] int32 (K = max kept count, at
    least 1; tail padded with 0) and kv_cnt [H, nQB] int32.
    """
    H, nQB, nKB = block_mask.shape
    keep = block_mask & _causal_blocks(nQB, nKB, block_mask.device)
    cnt = keep.sum(-1, dtype=torch.int32)  # [H, nQB]
    K = max(int(cnt.max()) if cnt.numel() else 0, 1)
    # A stable sort of ~keep puts kept blocks first, in ascending key-block order.
    idx = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :K]
    idx = torch.where(torch.arange(K, device=idx.device) < cnt[..., None], idx, torch.zeros_like(idx))
    return idx.to(torch.int32).contiguous(), cnt.contiguous()
