"""Block-sparse causal prefill (flash-attention forward) on triton, skipping masked-out key blocks.

One program per (query block, head). Blocks sit at absolute multiples of BLOCK for queries and keys (the geometry in
reference.py): with a past of q0 = S - T cached tokens the first query block may start before q0, and its rows
before q0 are masked off on load and store. Each program walks only the key blocks listed for it in kv_idx (built
from the block mask by reference.mask_to_kv_indices), so work scales with the kept blocks, not with T * S. The
online softmax runs in base 2 internally (exp2 with log2(e) folded into the scale); nothing in base 2 leaves the
kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeld_cell.kernels.common import dot

from .reference import block_grid, check_block_mask, check_qkv, mask_to_kv_indices

_LOG2E = 1.4426950408889634


@triton.jit
def _block_sparse_attn_fwd_kernel(
    q_ptr,  # [T, H, D], query row i at absolute position q0 + i
    k_ptr,  # [S, Hkv, D]
    v_ptr,  # [S, Hkv, D]
    out_ptr,  # [T, H, D]
    kv_idx_ptr,  # [H, nQB, K] int32 kept key blocks, ascending
    kv_cnt_ptr,  # [H, nQB] int32
    qk_scale,  # sm_scale * log2(e)
    q0,  # cached tokens before the first query (S - T)
    S,  # keys
    QB0,  # absolute index of the first query block (q0 // BLOCK)
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_ih, stride_ib,
    stride_ch,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,  # block_size, for queries and keys
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0)  # query block row, absolute block QB0 + qb
    h = tl.program_id(1)
    hkv = h // G
    offs_m = ((QB0 + qb) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # absolute; int64: S * H * D can pass 2**31
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    row_ok = (offs_m >= q0) & (offs_m < S)  # rows before q0 are past tokens
    q = tl.load(
        q_ptr + (offs_m - q0)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK, BLOCK_D]  # fmt: skip
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    cnt = tl.load(kv_cnt_ptr + h * stride_ch + qb)
    for i in range(0, cnt):
        kb = tl.load(kv_idx_ptr + h * stride_ih + qb * stride_ib + i)
        offs_n = (kb * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        kv_mask = (offs_n[:, None] < S) & d_mask[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * stride_kt + hkv * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), IEEE)
        keep = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < S)  # causal within the diagonal block
        s = tl.where(keep, s * qk_scale, float("-inf"))  # [BLOCK, BLOCK], log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing kept so far
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs_n[:, None] * stride_vt + hkv * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p, v, IEEE)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no kept key stays 0
    tl.store(
        out_ptr + (offs_m - q0)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :],
    )  # fmt: skip


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor | None = None,
    block_size: int = 64,
    sm_scale: float | None = None,
    kv_indices: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Block-sparse causal attention for one sequence, after S - T cached tokens (0: a fresh prefill).

    Args:
        q: [T, H, D] fp32/bf16/fp16 at positions S-T..S-1; k, v: [S, Hkv, D] same dtype (past keys, then the new
            ones), S >= T, H = G * Hkv; last dims contiguous.
        block_mask: [H, nQB, nKB] bool, bottom-right aligned (reference.py: key blocks at multiples of block_size,
            nKB = ceil(S / block_size), query blocks (S - T) // block_size .. nKB - 1); with no past the square
            [H, nB, nB]. Blocks right of the diagonal are ignored.
        block_size: query and key block size, a power of two >= 16.
        kv_indices: precomputed (kv_idx [H, nQB, K] int32, kv_cnt [H, nQB] int32) from
            reference.mask_to_kv_indices, to reuse across layers; replaces block_mask.
    Returns:
        out [T, H, D] in q.dtype; rows with no kept key are 0.
    """
    T, H, Hkv, D = check_qkv(q, k, v)
    S = k.shape[0]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    qb0, nQB, _ = block_grid(T, S, block_size)
    if kv_indices is None:
        if block_mask is None:
            raise ValueError("give block_mask or kv_indices")
        check_block_mask(block_mask, H, T, block_size, S)
        kv_idx, kv_cnt = mask_to_kv_indices(block_mask)
    else:
        kv_idx, kv_cnt = kv_indices
        if kv_idx.dim() != 3 or tuple(kv_idx.shape[:2]) != (H, nQB) or tuple(kv_cnt.shape) != (H, nQB):
            raise ValueError(f"kv_indices must be ([H={H}, nQB={nQB}, K], [H, nQB]); got "
                             f"{tuple(kv_idx.shape)}, {tuple(kv_cnt.shape)}")  # fmt: skip
        if kv_idx.dtype != torch.int32 or kv_cnt.dtype != torch.int32:
            raise ValueError("kv_indices must be int32")
        kv_idx, kv_cnt = kv_idx.contiguous(), kv_cnt.contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    scale = (D**-0.5 if sm_scale is None else float(sm_scale)) * _LOG2E
    extra = {}
    if num_warps is not None:
        extra["num_warps"] = num_warps
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _block_sparse_attn_fwd_kernel[(nQB, H)](
        q, k, v, out, kv_idx, kv_cnt, scale, S - T, S, qb0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), kv_idx.stride(0), kv_idx.stride(1), kv_cnt.stride(0),
        G=H // Hkv, D=D, BLOCK=block_size, BLOCK_D=max(16, triton.next_power_of_2(D)),
        IEEE=q.dtype == torch.float32, **extra,
    )  # fmt: skip
    return out
