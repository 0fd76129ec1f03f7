"""Merge partial attention states on triton. NATURAL-LOG LSE in and out (same contract as merge/reference.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_states


@triton.jit(do_not_specialize=["S"])   # nor by S % 16 == 0 / S == 1: one compiled kernel for every split count
def _merge_states_kernel(
    outs_ptr,  # [S, R, D] any float
    lses_ptr,  # [S, R] fp32, natural log
    res_out_ptr,  # [R, D] out dtype
    res_lse_ptr,  # [R] fp32
    stride_os,
    stride_or,
    stride_ls,
    S,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per row r = (leading index, head); it reads S lse scalars and S out vectors of D. S is a runtime
    # loop bound, not a block size: the split count grows with the context, and one compiled kernel serves them all.
    r = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(lses_ptr + r)
    for s in range(1, S):
        m = tl.maximum(m, tl.load(lses_ptr + s * stride_ls + r))
    # All parts empty -> m = -inf; 0 keeps exp() finite and gives out 0, lse -inf.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(0, S):
        w = tl.exp(tl.load(lses_ptr + s * stride_ls + r) - m_safe)
        denom += w
        o = tl.load(outs_ptr + s * stride_os + r * stride_or + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        # An empty part (w == 0) must not leak NaN from its out through 0 * NaN.
        acc += tl.where(w > 0, w * o, 0.0)
    safe = tl.where(denom > 0, denom, 1.0)
    tl.store(res_out_ptr + r * D + offs_d, (acc / safe).to(res_out_ptr.dtype.element_ty), mask=offs_d < D)
    tl.store(res_lse_ptr + r, tl.where(denom > 0, m_safe + tl.log(safe), float("-inf")))


@triton.jit
def _merge_two_states_kernel(
    a_out_ptr,  # [R, D]
    a_lse_ptr,  # [R] natural log
    b_out_ptr,  # [R, D]
    b_lse_ptr,  # [R] natural log
    res_out_ptr,  # [R, D]
    res_lse_ptr,  # [R] fp32
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    la = tl.load(a_lse_ptr + r).to(tl.float32)
    lb = tl.load(b_lse_ptr + r).to(tl.float32)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    oa = tl.load(a_out_ptr + r * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    ob = tl.load(b_out_ptr + r * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    denom = wa + wb
    acc = tl.where(wa > 0, wa * oa, 0.0) + tl.where(wb > 0, wb * ob, 0.0)
    safe = tl.where(denom > 0, denom, 1.0)
    tl.store(res_out_ptr + r * D + offs_d, (acc / safe).to(res_out_ptr.dtype.element_ty), mask=offs_d < D)
    tl.store(res_lse_ptr + r, tl.where(denom > 0, m_safe + tl.log(safe), float("-inf")))


def merge_states_n(
    outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S stacked partial states.

    Args:
        outs: [S, ..., H, D] fp32/bf16/fp16, each part normalised over its own keys.
        lses: [S, ..., H] float, NATURAL-LOG LSE per part; -inf marks an empty part.
        out_dtype: dtype of the merged out (default outs.dtype).
    Returns:
        out [..., H, D] out_dtype, lse [..., H] fp32 natural log (-inf and out 0 where every part is empty).
    """
    check_states(outs, lses)
    S, D = outs.shape[0], outs.shape[-1]
    lead = outs.shape[1:-1]
    outs3 = outs.reshape(S, -1, D).contiguous()  # [S, R, D]
    lses2 = lses.reshape(S, -1).float().contiguous()  # [S, R]
    R = outs3.shape[1]
    res_out = torch.empty((R, D), dtype=out_dtype or outs.dtype, device=outs.device)
    res_lse = torch.empty((R,), dtype=torch.float32, device=outs.device)
    if R > 0:
        _merge_states_kernel[(R,)](
            outs3, lses2, res_out, res_lse,
            outs3.stride(0), outs3.stride(1), lses2.stride(0), S,
            D=D, BLOCK_D=triton.next_power_of_2(D),
        )  # fmt: skip
    return res_out.reshape(*lead, D), res_lse.reshape(lead)


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states without stacking them.

    Args:
        out_a, out_b: [..., H, D] same float dtype.
        lse_a, lse_b: [..., H] float, NATURAL-LOG LSE; -inf marks an empty part.
    Returns:
        out [..., H, D] in out_a.dtype, lse [..., H] fp32 natural log.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.dtype != out_b.dtype:
        raise ValueError(
            f"two-way merge needs equal shapes and dtypes: out {tuple(out_a.shape)}/{out_a.dtype} vs "
            f"{tuple(out_b.shape)}/{out_b.dtype}, lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    check_states(out_a.unsqueeze(0), lse_a.unsqueeze(0))
    D = out_a.shape[-1]
    lead = out_a.shape[:-1]
    a, b = out_a.reshape(-1, D).contiguous(), out_b.reshape(-1, D).contiguous()
    la, lb = lse_a.reshape(-1).float().contiguous(), lse_b.reshape(-1).float().contiguous()
    R = a.shape[0]
    res_out = torch.empty_like(a)
    res_lse = torch.empty((R,), dtype=torch.float32, device=a.device)
    if R > 0:
        _merge_two_states_kernel[(R,)](a, la, b, lb, res_out, res_lse, D=D, BLOCK_D=triton.next_power_of_2(D))
    return res_out.reshape(*lead, D), res_lse.reshape(lead)
