"""Block-sparse causal prefill attention, plain torch: the CPU path and the triton kernel's ground truth.

One sequence at a time: q [T, H, D], k and v [T, Hkv, D] with H = G * Hkv (query head h reads kv head h // G).
Tokens are cut into blocks of ``block_size`` (same size for queries and keys), nB = ceil(T / block_size), and a
block mask [H, nB, nB] bool says which key blocks each (head, query block) attends to. The attention is exact for
that mask: ordinary causal softmax over the kept keys only. Blocks above the diagonal are ignored (causality wins);
a query row that keeps no key at all returns zeros. ``masked_dense_attention`` is the obviously-correct oracle
(dense cost); ``block_sparse_attention`` gathers only the kept blocks and is the CPU production path.

The pattern estimate follows MInference's "vertical-slash" idea: the last query block's attention to every key
shows which key columns (vertical) and which diagonals (slash) carry the mass; every query block then keeps the
top vertical blocks, the blocks the top diagonals cross, the first (sink) block and its local blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DENSE_BELOW_TOKENS = 4096  # below this a dense flash kernel beats the sparse bookkeeping
DENSE_ABOVE_DENSITY = 0.6  # above this fraction of causal blocks, sparse saves too little


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q [T, H, D], k/v [T, Hkv, D]; return (T, H, Hkv, D)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    T, H, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k/v {tuple(k.shape)} must be [T={T}, Hkv, D={D}]")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"H={H} must be a positive multiple of Hkv={Hkv} (GQA)")
    if not (q.is_floating_point() and q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    return T, H, Hkv, D


def check_block_mask(block_mask: torch.Tensor, H: int, T: int, block_size: int) -> int:
    """Validate block_mask [H, nB, nB] bool for T tokens; return nB."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    nB = (T + block_size - 1) // block_size
    if block_mask.dtype != torch.bool or tuple(block_mask.shape) != (H, nB, nB):
        raise ValueError(
            f"block_mask must be bool [H={H}, nB={nB}, nB={nB}] for T={T}, block_size={block_size}; "
            f"got {tuple(block_mask.shape)} {block_mask.dtype}"
        )
    return nB


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None
) -> torch.Tensor:
    """Dense causal attention via torch SDPA. q [T, H, D], k/v [T, Hkv, D] -> out [T, H, D] in q.dtype."""
    T, H, Hkv, D = check_qkv(q, k, v)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=sm_scale, enable_gqa=Hkv != H,
    )  # [H, T, D]  # fmt: skip
    return out.transpose(0, 1).contiguous()


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
        q: [T, H, D] float; k, v: [T, Hkv, D] same dtype.
        block_mask: [H, nB, nB] bool, nB = ceil(T / block_size); entries above the diagonal are ignored.
        max_chunk_elems: bound on the fp32 score elements materialised at once (query rows are chunked by blocks).
    Returns:
        out [T, H, D] in q.dtype; rows with no kept key are 0.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    check_block_mask(block_mask, H, T, block_size)
    G = H // Hkv
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    out = torch.empty_like(q)
    if T == 0:
        return out
    kf = k.float().permute(1, 0, 2)  # [Hkv, T, D]
    vf = v.float().permute(1, 0, 2)
    pos = torch.arange(T, device=q.device)
    rows_per_chunk = max(block_size, (max_chunk_elems // max(H * T, 1)) // block_size * block_size)
    for r0 in range(0, T, rows_per_chunk):  # loop over chunks of query blocks, not tokens
        r1 = min(T, r0 + rows_per_chunk)
        qc = q[r0:r1].float().permute(1, 0, 2).reshape(Hkv, G * (r1 - r0), D)  # [Hkv, G*rows, D]
        s = torch.bmm(qc, kf[:, :r1].transpose(1, 2)).reshape(H, r1 - r0, r1) * scale  # [H, rows, keys]
        bm = block_mask[:, r0 // block_size : (r1 - 1) // block_size + 1, : (r1 - 1) // block_size + 1]
        # r0 is a multiple of block_size, so block row qb - r0 // block_size starts at local row 0.
        keep = bm.repeat_interleave(block_size, 1)[:, : r1 - r0].repeat_interleave(block_size, 2)[:, :, :r1]
        keep = keep & (pos[None, r0:r1, None] >= pos[None, None, :r1])  # causal
        s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no kept key
        p = torch.exp(s - m)
        d = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(d > 0, d, torch.ones_like(d))
        o = torch.bmm(p.reshape(Hkv, G * (r1 - r0), r1), vf[:, :r1])  # [Hkv, G*rows, D]
        out[r0:r1] = o.reshape(H, r1 - r0, D).permute(1, 0, 2).to(q.dtype)
    return out


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int = 64,
    sm_scale: float | None = None,
    max_chunk_elems: int = 1 << 21,
) -> torch.Tensor:
    """Block-sparse causal attention that only touches kept blocks (the CPU production path), fp32 math.

    Each query block gathers its kept key blocks (padded to the chunk's largest count and masked), so the work is
    proportional to the kept blocks. Small chunks (the default 2M elements, measured on a 2-core CPU) keep the
    gathered K/V in cache and the padding low. Same contract and result as masked_dense_attention.

    Args:
        q: [T, H, D] float; k, v: [T, Hkv, D] same dtype.
        block_mask: [H, nB, nB] bool, nB = ceil(T / block_size); entries above the diagonal are ignored.
        max_chunk_elems: bound on the fp32 elements gathered / scored at once (query blocks are chunked).
    Returns:
        out [T, H, D] in q.dtype; rows with no kept key are 0.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    nB = check_block_mask(block_mask, H, T, block_size)
    G, bs = H // Hkv, block_size
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    if T == 0:
        return torch.empty_like(q)
    pad = nB * bs - T
    # [T, h, D] -> [h, nB, bs, D] fp32, zero-padded to whole blocks
    qb = F.pad(q.float(), (0, 0, 0, 0, 0, pad)).reshape(nB, bs, H, D).permute(2, 0, 1, 3)
    kb = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).reshape(nB, bs, Hkv, D).permute(2, 0, 1, 3)
    vb = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).reshape(nB, bs, Hkv, D).permute(2, 0, 1, 3)
    kv_idx, kv_cnt = mask_to_kv_indices(block_mask)  # [H, nB, K], [H, nB]
    kv_idx, kv_cnt = kv_idx.long(), kv_cnt.long()
    head_kv = (torch.arange(H, device=q.device) // G)[:, None, None]  # [H, 1, 1]
    within = torch.arange(bs, device=q.device)
    out = torch.empty(H, nB, bs, D, device=q.device)
    per_qblock = H * kv_idx.shape[-1] * bs * max(D, bs)
    C = max(1, max_chunk_elems // max(per_qblock, 1))  # query blocks per chunk
    for c0 in range(0, nB, C):  # loop over chunks of query blocks, not tokens
        c1 = min(nB, c0 + C)
        cnt = kv_cnt[:, c0:c1]  # [H, Cc]
        K = max(int(cnt.max()), 1)
        idx = kv_idx[:, c0:c1, :K]  # [H, Cc, K]
        kg = kb[head_kv, idx].flatten(2, 3)  # [H, Cc, K*bs, D]
        vg = vb[head_kv, idx].flatten(2, 3)
        kpos = (idx[..., None] * bs + within).flatten(2)  # [H, Cc, K*bs] key positions
        slot_ok = (torch.arange(K, device=q.device) < cnt[..., None]).repeat_interleave(bs, -1)  # padding slots
        qpos = (torch.arange(c0, c1, device=q.device)[:, None] * bs + within)[None, :, :, None]  # [1, Cc, bs, 1]
        keep = (slot_ok & (kpos < T))[:, :, None, :] & (kpos[:, :, None, :] <= qpos)  # [H, Cc, bs, K*bs]
        # SDPA with a bool mask is exact for the mask and fuses the softmax (no [.., K*bs] fp32 scores kept).
        o = F.scaled_dot_product_attention(qb[:, c0:c1], kg, vg, attn_mask=keep, scale=scale)
        # A row with no kept key: SDPA gives 0 or NaN depending on the torch version; the contract says 0.
        out[:, c0:c1] = torch.where(keep.any(-1, keepdim=True), o, 0.0)
    return out.permute(1, 2, 0, 3).reshape(nB * bs, H, D)[:T].to(q.dtype)


def causal_block_count(nB: int) -> int:
    """Blocks on or below the diagonal of an nB x nB block grid."""
    return nB * (nB + 1) // 2


def block_density(block_mask: torch.Tensor) -> float:
    """Fraction of causal (on/below diagonal) blocks kept, over all heads; block_mask [H, nB, nB]."""
    H, nB, _ = block_mask.shape
    causal = torch.ones(nB, nB, dtype=torch.bool, device=block_mask.device).tril()
    return float((block_mask & causal).sum()) / max(H * causal_block_count(nB), 1)


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
) -> torch.Tensor:
    """Cheap online vertical-slash block pattern from the last queries' attention.

    Args:
        q: [T, H, D]; k: [T, Hkv, D].
        keep_ratio: fraction of the nB key blocks chosen as vertical blocks and as diagonal offsets (each);
            vertical_topk / slash_topk override the counts.
        local_blocks: most recent key blocks always kept per query block (the diagonal counts as one).
        last_q: how many final query rows to score (default block_size).
    Returns:
        block_mask [H, nB, nB] bool, causal, always holding the sink block (key block 0) and the local blocks.
    """
    T, H, Hkv, D = check_qkv(q, k, k)
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    G = H // Hkv
    nB = (T + block_size - 1) // block_size
    dev = q.device
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    n_v = vertical_topk if vertical_topk is not None else max(1, math.ceil(keep_ratio * nB))
    n_s = slash_topk if slash_topk is not None else max(1, math.ceil(keep_ratio * nB))
    n_v, n_s = min(max(n_v, 0), nB), min(max(n_s, 0), nB)
    Lq = min(last_q or block_size, T)
    qpos = torch.arange(T - Lq, T, device=dev)  # absolute positions of the scored queries [Lq]
    kpos = torch.arange(T, device=dev)
    causal = kpos[None, :] <= qpos[:, None]  # [Lq, T]
    offset = (qpos[:, None] - kpos[None, :]).clamp(min=0).expand(G, Lq, T).reshape(G, Lq * T)  # diagonal index
    vert = torch.zeros(H, nB * block_size, device=dev)  # attention mass per key column
    slash = torch.zeros(H, nB * block_size, device=dev)  # attention mass per diagonal offset (query - key)
    for hk in range(Hkv):  # per kv head bounds memory at [G, Lq, T]
        qh = q[T - Lq :, hk * G : (hk + 1) * G].float().transpose(0, 1)  # [G, Lq, D]
        s = torch.matmul(qh, k[:, hk].float().t()) * scale  # [G, Lq, T]
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        vert[hk * G : (hk + 1) * G, :T] = a.sum(dim=1)
        slash[hk * G : (hk + 1) * G].scatter_add_(1, offset, a.reshape(G, Lq * T))  # masked entries add 0
    vert_blk = vert.reshape(H, nB, block_size).sum(-1)  # [H, nB] per key block
    slash_blk = slash.reshape(H, nB, block_size).sum(-1)  # [H, nB] per diagonal block offset

    qb = torch.arange(nB, device=dev)[:, None]
    kb = torch.arange(nB, device=dev)[None, :]
    diff = qb - kb  # [nB, nB] block offset of (query block, key block)
    mask = ((kb == 0) | ((diff >= 0) & (diff < local_blocks))).expand(H, nB, nB).clone()  # sink + local
    if n_v:
        vsel = torch.zeros(H, nB, dtype=torch.bool, device=dev)
        vsel.scatter_(1, vert_blk.topk(n_v, dim=1).indices, True)
        mask |= vsel[:, None, :]
    if n_s:
        ssel = torch.zeros(H, nB + 1, dtype=torch.bool, device=dev)  # one spare slot for diff - 1 < 0
        ssel.scatter_(1, slash_blk.topk(n_s, dim=1).indices, True)
        # A token diagonal with offset in block ob crosses key blocks qb - ob and qb - ob - 1 of query block qb.
        d0 = diff.clamp(0, nB)
        d1 = (diff - 1).clamp(0, nB)
        mask |= ssel[:, d0] | (ssel[:, d1] & (diff >= 1))
    return mask & (diff >= 0)


def choose_path(
    T: int,
    density: float | None = None,
    min_tokens: int = DENSE_BELOW_TOKENS,
    max_density: float = DENSE_ABOVE_DENSITY,
) -> str:
    """ "dense" for short prompts (T < min_tokens) or dense-ish masks (density > max_density), else "sparse"."""
    if T < min_tokens or (density is not None and density > max_density):
        return "dense"
    return "sparse"


def mask_to_kv_indices(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept causal key blocks per (head, query block), ascending: the triton kernel's iteration lists.

    block_mask [H, nB, nB] bool -> kv_idx [H, nB, K] int32 (K = max kept count, at least 1; tail padded with 0)
    and kv_cnt [H, nB] int32.
    """
    H, nB, _ = block_mask.shape
    causal = torch.ones(nB, nB, dtype=torch.bool, device=block_mask.device).tril()
    keep = block_mask & causal
    cnt = keep.sum(-1, dtype=torch.int32)  # [H, nB]
    K = max(int(cnt.max()) if cnt.numel() else 0, 1)
    # A stable sort of ~keep puts kept blocks first, in ascending key-block order.
    idx = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :K]
    idx = torch.where(torch.arange(K, device=idx.device) < cnt[..., None], idx, torch.zeros_like(idx))
    return idx.to(torch.int32).contiguous(), cnt.contiguous()
