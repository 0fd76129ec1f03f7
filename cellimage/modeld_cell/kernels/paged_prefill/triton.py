"""Paged prefill attention on triton: flash attention of a chunk's query rows over the paged cache.

One program owns BLOCK_M query rows of one query head. It walks the keys 0..(its last row's position) in tiles of
BLOCK_N, looking up each token's physical block in the block table (any BLOCK_SIZE), dequantizing an int8 / fp8 tile
in registers with its per-token scales, and keeps the online softmax in fp32. The past is read where it lies: a
chunk after a cached prefix neither gathers nor expands it. LSE is NATURAL LOG.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeld_cell.kernels.common import dot
from modeld_cell.kernels.paged_decode.triton import online_softmax_step

from .reference import check_prefill_inputs


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [NB, BS, Hkv, D]
    v_ptr,  # [NB, BS, Hkv, D]
    ks_ptr,  # [NB, BS, Hkv] scales (QUANT only)
    vs_ptr,
    bt_ptr,  # [MB] int32
    out_ptr,  # [T, Hq, D]
    T, past, sm_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,
    stride_ot, stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hkv = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < T
    d_mask = offs_d < D
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    pos = past + offs_m  # absolute position of each row
    end = tl.minimum(past + (pid_m + 1) * BLOCK_M, past + T)  # keys this block of rows can see

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        tok = n0 + offs_n
        valid = tok < end
        phys = tl.load(bt_ptr + tok // PAGE, mask=valid, other=0).to(tl.int64)
        slot = tok % PAGE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + phys[:, None] * stride_kb + slot[:, None] * stride_kt + hkv * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + phys[:, None] * stride_vb + slot[:, None] * stride_vt + hkv * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if QUANT:
            s_off = phys * stride_sb + slot * stride_st + hkv * stride_sh
            kscale = tl.load(ks_ptr + s_off, mask=valid, other=0.0).to(tl.float32)
            vscale = tl.load(vs_ptr + s_off, mask=valid, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * kscale[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * vscale[:, None]).to(q.dtype)
        s = dot(q, tl.trans(k), IEEE) * sm_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (tok[None, :] <= pos[:, None]), s, float("-inf"))
        # key 0 is visible to every row (the first tile's), so the running max is finite from there on: the step's
        # condition holds although a later tile may hide all its keys from a row
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + dot(p, v, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


# Launch parameters per head dim (BLOCK_M, BLOCK_N, num_warps, num_stages): 64 x 64 tiles keep a bf16 Q, K and V
# tile in registers at D <= 128 (as FlashAttention-2's forward on sm80+); larger heads halve the key tile.
LAUNCH = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (64, 32, 8, 1)}


def launch_params(D: int, T: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim D and T query rows; tl.dot needs tiles >= 16."""
    bm, bn, warps, stages = LAUNCH.get(triton.next_power_of_2(max(D, 16)), (64, 64, 4, 2))
    return min(bm, max(16, triton.next_power_of_2(T))), bn, warps, stages


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  past: int, sm_scale: float | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T new rows over past + T paged tokens.

    Args:
        q: [T, Hq, D] fp32/bf16/fp16, rows at positions past..past+T-1; head h reads kv head h // (Hq // Hkv).
        k_cache, v_cache: [NB, BS, Hkv, D] in q's dtype, or int8 / float8_e4m3fn with k_scale, v_scale.
        block_table: [MB] int32, the session's blocks in order, covering past + T tokens.
        past: cached tokens before the chunk (python int: the caller knows it, no host sync).
        sm_scale: default D ** -0.5.
        k_scale, v_scale: [NB, BS, Hkv] (fp16 / fp32), value = stored * scale; None for an unquantized cache.
    Returns:
        [T, Hq, D] in q's dtype.
    """
    T, Hq, Hkv, G, D, BS = check_prefill_inputs(q, k_cache, v_cache, block_table, past, k_scale, v_scale)
    out = torch.empty_like(q)
    if T == 0:
        return out
    quant = k_scale is not None
    ks = k_scale if quant else q.new_zeros(1, 1, 1)
    vs = v_scale if quant else ks
    bm, bn, warps, stages = launch_params(D, T)
    bt = block_table.contiguous()
    _paged_prefill_kernel[(triton.cdiv(T, bm), Hq)](
        q, k_cache, v_cache, ks, vs, bt, out, T, past, D**-0.5 if sm_scale is None else float(sm_scale),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        out.stride(0), out.stride(1),
        G=G, D=D, PAGE=BS, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, triton.next_power_of_2(D)),
        QUANT=quant, IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
