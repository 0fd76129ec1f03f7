"""Fused quantized-KV paged decode on triton: int8 / fp8 / int4 tiles are dequantized in registers, never in HBM.

Same split-KV shape as paged_decode/triton.py: one program per (sequence, kv head, split) for all G query heads,
partial (out, lse) per split, merged by merge/triton.py. LSE is NATURAL LOG.

For int8 and fp8 the per-token scale factors out of the dot products, so the kernel runs the dots on the raw
integer/fp8 values (exact in bf16/fp16/fp32) and applies the scales to the [G, BLOCK_N] scores and probabilities:
    s[g, n] = k_scale[n] * (q[g] . kq[n]),     out[g] = sum_n (p[g, n] * v_scale[n]) vq[n]
int4 has group scales along D, so its tile is dequantized element-wise in registers before the dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeld_cell.kernels.common import dot
from modeld_cell.kernels.paged_decode.triton import finish_splits, online_softmax_step, plan_splits, store_split

from .reference import INT4_GROUP, check_quant_inputs


@triton.jit
def _quant_paged_decode_kernel(
    q_ptr,  # [B, Hq, D] float
    k_ptr,  # [NB, BS, Hkv, DC] int8 / fp8 / uint8 (int4 packed, DC = D // 2)
    v_ptr,
    ks_ptr,  # [NB, BS, Hkv] fp16, or [NB, BS, Hkv, D // 32] for int4 (upcast to fp32 on load)
    vs_ptr,
    bt_ptr,  # [B, MB] int32
    seq_lens_ptr,  # [B] int32
    part_out_ptr,  # [S, B, Hq, D] fp32
    part_lse_ptr,  # [S, B, Hq] fp32
    sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    stride_btb,
    stride_ps, stride_pb, stride_ph,
    stride_ls, stride_lb,
    SPLIT_LEN,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    INT4: tl.constexpr,  # packed int4 with group scales; else int8/fp8 with per-token scales
    GROUP: tl.constexpr,  # int4 group size along D
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
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
    heads = hkv * G + offs_g
    g_mask = offs_g < G
    d_mask = offs_d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]  # fmt: skip
    if INT4:
        d_col = offs_d // 2  # byte holding element d
        shift = (offs_d % 2) * 4  # even d: low nibble, odd d: high nibble
        s_col = offs_d // GROUP  # group scale of element d
    else:
        d_col = offs_d

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        valid = tok < end
        phys = tl.load(bt_ptr + b * stride_btb + tok // PAGE, mask=valid, other=0).to(tl.int64)
        slot = tok % PAGE
        kv_mask = valid[:, None] & d_mask[None, :]
        k_raw = tl.load(
            k_ptr + phys[:, None] * stride_kb + slot[:, None] * stride_kt + hkv * stride_kh + d_col[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        v_raw = tl.load(
            v_ptr + phys[:, None] * stride_vb + slot[:, None] * stride_vt + hkv * stride_vh + d_col[None, :],
            mask=kv_mask, other=0.0,
        )  # fmt: skip
        if INT4:
            ks = tl.load(
                ks_ptr + phys[:, None] * stride_ksb + slot[:, None] * stride_kst + hkv * stride_ksh + s_col[None, :],
                mask=kv_mask, other=0.0,
            ).to(tl.float32)  # [BLOCK_N, BLOCK_D] group scale per element  # fmt: skip
            vs = tl.load(
                vs_ptr + phys[:, None] * stride_vsb + slot[:, None] * stride_vst + hkv * stride_vsh + s_col[None, :],
                mask=kv_mask, other=0.0,
            ).to(tl.float32)  # fmt: skip
            k = ((((k_raw.to(tl.int32) >> shift[None, :]) & 0xF) - 8).to(tl.float32) * ks).to(q.dtype)
            v = ((((v_raw.to(tl.int32) >> shift[None, :]) & 0xF) - 8).to(tl.float32) * vs).to(q.dtype)
            s = dot(q, tl.trans(k), IEEE)
        else:
            ks = tl.load(ks_ptr + phys * stride_ksb + slot * stride_kst + hkv * stride_ksh, mask=valid, other=0.0)
            vs = tl.load(vs_ptr + phys * stride_vsb + slot * stride_vst + hkv * stride_vsh, mask=valid, other=0.0)
            ks = ks.to(tl.float32)  # fp16 in memory (2 bytes per token per head), fp32 in registers
            vs = vs.to(tl.float32)
            k = k_raw.to(q.dtype)  # |int8| <= 127 and fp8 e4m3 are exact in bf16/fp16/fp32
            v = v_raw.to(q.dtype)
            s = dot(q, tl.trans(k), IEEE) * ks[None, :]
        s = tl.where(valid[None, :], s * sm_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if INT4:
            pw = p
        else:
            pw = p * vs[None, :]  # fold the per-token V scale into the probabilities
        acc = acc * alpha[:, None] + dot(pw, v, IEEE)

    store_split(
        acc, m_i, l_i, part_out_ptr, part_lse_ptr, sp, b, heads, offs_d, g_mask, d_mask,
        stride_ps, stride_pb, stride_ph, stride_ls, stride_lb,
    )  # fmt: skip


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
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused quantized-KV paged GQA decode (split-KV flash-decoding).

    Args:
        q: [B, Hq, D] fp32/bf16/fp16, Hq = G * Hkv.
        k_cache, v_cache: [NB, BS, Hkv, D] int8 or torch.float8_e4m3fn, or [NB, BS, Hkv, D // 2] uint8 (int4).
        k_scale, v_scale: fp16 [NB, BS, Hkv] (int8/fp8) or [NB, BS, Hkv, D // 32] (int4), as ``reference.quantize``
            makes them; upcast to fp32 in the kernel.
        block_tables: [B, MB] int32.  seq_lens: [B] int32 (0 -> out 0, lse -inf).
        fmt: "int8" | "fp8" | "int4", inferred from the cache dtype when None.
        sm_scale: default D ** -0.5.  num_splits, block_n, check_tables: as in paged_decode.triton.paged_decode.
    Returns:
        out [B, Hq, D] q.dtype; with return_lse also lse [B, Hq] fp32, NATURAL LOG.
    """
    fmt, dims = check_quant_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, fmt, check_tables)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale), ("v_scale", v_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    B, Hq, Hkv, G, D, NB, BS, MB = dims
    block_n, S, split_len, scale, part_out, part_lse = plan_splits(q, dims, block_n, num_splits, sm_scale)
    bt = block_tables.contiguous()
    sl = seq_lens.contiguous()
    if B > 0:
        _quant_paged_decode_kernel[(B, Hkv, S)](
            q, k_cache, v_cache, k_scale, v_scale, bt, sl, part_out, part_lse, scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
            v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
            bt.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            split_len,
            G=G, D=D, PAGE=BS, INT4=fmt == "int4", GROUP=INT4_GROUP,
            BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        )  # fmt: skip
    out, lse = finish_splits(part_out, part_lse, q.dtype)
    return (out, lse) if return_lse else out
