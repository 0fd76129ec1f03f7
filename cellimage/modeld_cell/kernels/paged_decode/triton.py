"""Paged GQA decode attention on triton: split-KV flash-decoding, then the merge kernel combines the splits.

Each program owns one (sequence b, kv head, split) and all G query heads of that kv head, so a K/V tile is read
from HBM once per group, not once per query head. It walks its token range in tiles of BLOCK_N, looking up the
physical block of every token in block_tables (any BLOCK_SIZE works, including 1), and writes a partial
(out, lse) that merge/triton.py combines. LSE is NATURAL LOG everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeld_cell.kernels.common import dot
from modeld_cell.kernels.merge.triton import merge_states_n

from .reference import check_paged_inputs


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of the online softmax (natural exp): s [G, N] scores, m_i / l_i [G] running max and sum.

    Returns p [G, N], the rescale alpha [G] for the accumulator, and the new m_i, l_i. Every tile holds at least one
    valid token, so the new max is finite and exp() never sees -inf - -inf."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def store_split(
    acc, m_i, l_i, part_out_ptr, part_lse_ptr, sp, b, heads, offs_d, g_mask, d_mask,
    stride_ps, stride_pb, stride_ph, stride_ls, stride_lb,
):  # fmt: skip
    """Normalise one split's accumulator and write its (out, lse) partial; an empty split writes 0 and -inf."""
    empty = l_i == 0.0  # split starts at or past seq_len
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        part_out_ptr + sp * stride_ps + b * stride_pb + heads[:, None] * stride_ph + offs_d[None, :],
        out, mask=g_mask[:, None] & d_mask[None, :],
    )  # fmt: skip
    tl.store(part_lse_ptr + sp * stride_ls + b * stride_lb + heads, lse, mask=g_mask)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [NB, BS, Hkv, D]
    v_ptr,  # [NB, BS, Hkv, D]
    bt_ptr,  # [B, MB] int32
    seq_lens_ptr,  # [B] int32
    part_out_ptr,  # [S, B, Hq, D] fp32
    part_lse_ptr,  # [S, B, Hq] fp32
    sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ps, stride_pb, stride_ph,
    stride_ls, stride_lb,
    SPLIT_LEN,  # tokens per split, a multiple of BLOCK_N
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,  # BLOCK_SIZE of the cache
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot instead of tf32
):  # fmt: skip
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = sp * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = hkv * G + offs_g  # query heads of this group
    g_mask = offs_g < G
    d_mask = offs_d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]  # fmt: skip

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n  # logical token positions [BLOCK_N]
        valid = tok < end
        phys = tl.load(bt_ptr + b * stride_btb + tok // PAGE, mask=valid, other=0).to(tl.int64)
        slot = tok % PAGE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + phys[:, None] * stride_kb + slot[:, None] * stride_kt + hkv * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # [BLOCK_N, BLOCK_D]  # fmt: skip
        s = dot(q, tl.trans(k), IEEE)
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v = tl.load(
            v_ptr + phys[:, None] * stride_vb + slot[:, None] * stride_vt + hkv * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        acc = acc * alpha[:, None] + dot(p, v, IEEE)

    store_split(
        acc, m_i, l_i, part_out_ptr, part_lse_ptr, sp, b, heads, offs_d, g_mask, d_mask,
        stride_ps, stride_pb, stride_ph, stride_ls, stride_lb,
    )  # fmt: skip


def default_block_n(D: int) -> int:
    """Tokens per tile: 64 keeps a [64, D<=128] bf16 K tile plus V in registers; tl.dot needs >= 16."""
    return 64 if D <= 128 else 32


def choose_num_splits(B: int, Hkv: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Splits per (seq, kv head) so that B * Hkv * splits covers about two waves of SMs.

    Uses the block-table capacity (MB * BLOCK_SIZE) rather than the true max length, so no host sync is needed;
    splits past a sequence's end are empty (lse -inf) and the merge ignores them.
    """
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = triton.cdiv(2 * sms, max(B * Hkv, 1))
    # At least 256 tokens per split: below that the merge costs more than the parallelism buys.
    return max(1, min(want, triton.cdiv(max_ctx, max(256, block_n))))


def finish_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-split partials part_out [S, B, Hq, D] fp32, part_lse [S, B, Hq] into out [B, Hq, D], lse [B, Hq]."""
    if part_out.shape[0] == 1:
        return part_out[0].to(out_dtype), part_lse[0]
    return merge_states_n(part_out, part_lse, out_dtype=out_dtype)


def plan_splits(
    q: torch.Tensor, dims: tuple, block_n: int | None, num_splits: int | None, sm_scale: float | None
) -> tuple[int, int, int, float, torch.Tensor, torch.Tensor]:
    """Tile size, split count, tokens per split, softmax scale and the fp32 partial buffers of a split-KV decode.

    Shared by the plain and the quantized decode launchers: part_out [S, B, Hq, D], part_lse [S, B, Hq] (natural log).
    """
    B, Hq, Hkv, _G, D, _NB, BS, MB = dims
    block_n = block_n or default_block_n(D)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    S = num_splits or choose_num_splits(B, Hkv, MB * BS, block_n, q.device)
    split_len = triton.cdiv(triton.cdiv(max(MB * BS, 1), S), block_n) * block_n
    scale = D**-0.5 if sm_scale is None else float(sm_scale)
    part_out = torch.empty((S, B, Hq, D), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((S, B, Hq), dtype=torch.float32, device=q.device)
    return block_n, S, split_len, scale, part_out, part_lse


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    return_lse: bool = False,
    check_tables: bool = True,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode attention, split-KV flash-decoding.

    Args:
        q: [B, Hq, D] fp32/bf16/fp16, Hq = G * Hkv; query head h reads kv head h // G.
        k_cache, v_cache: [NB, BS, Hkv, D], same dtype as q, last dim contiguous.
        block_tables: [B, MB] int32 physical block ids; entries past a sequence's used blocks are ignored.
        seq_lens: [B] int32, 0 allowed (out 0, lse -inf).
        sm_scale: default D ** -0.5.
        check_tables: validate seq_lens/block_tables contents (host sync); shapes and dtypes are always checked.
        num_splits: KV splits per (seq, kv head); default fills about two waves of SMs.
        block_n: tokens per tile (power of two >= 16); default 64 (32 for D > 128).
    Returns:
        out [B, Hq, D] in q.dtype; with return_lse also lse [B, Hq] fp32, NATURAL LOG.
    """
    dims = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, check_tables=check_tables)
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} must equal q dtype {q.dtype} (use quant_kv for int8/fp8)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head) dim")
    B, Hq, Hkv, G, D, NB, BS, MB = dims
    block_n, S, split_len, scale, part_out, part_lse = plan_splits(q, dims, block_n, num_splits, sm_scale)
    bt = block_tables.contiguous()
    sl = seq_lens.contiguous()
    if B > 0:
        _paged_decode_kernel[(B, Hkv, S)](
            q, k_cache, v_cache, bt, sl, part_out, part_lse, scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            bt.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            split_len,
            G=G, D=D, PAGE=BS,
            BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        )  # fmt: skip
    out, lse = finish_splits(part_out, part_lse, q.dtype)
    return (out, lse) if return_lse else out
