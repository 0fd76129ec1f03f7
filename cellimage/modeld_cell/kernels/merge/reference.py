"""Merge partial attention states, plain torch (the CPU path and the triton kernel's ground truth).

A partial state is the attention of some queries over a subset of the keys (one KV split, or one GPU's KV shard):
``out_s`` is already normalised over that subset and ``lse_s`` is the NATURAL-LOG log-sum-exp of the scaled scores
over it. Merging is exact (the log-sum-exp identity FlashAttention's split-KV decode and vLLM's
``merge_attn_states`` rest on; vLLM uses natural-log LSE as here, FlashInfer base 2):

    m = max_s lse_s,  w_s = exp(lse_s - m),  out = sum_s w_s out_s / sum_s w_s,  lse = m + log sum_s w_s

An empty part has lse = -inf and contributes nothing, whatever its ``out`` holds (even NaN). When every part is empty
the result is out = 0 and lse = -inf, never NaN.
"""

from __future__ import annotations

import torch


def check_states(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """Raise ValueError unless outs [S, ..., H, D] and lses [S, ..., H] describe the same S parts."""
    if outs.dim() < 3:
        raise ValueError(f"outs must be [S, ..., H, D] with at least 3 dims, got shape {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(
            f"lses shape {tuple(lses.shape)} must equal outs shape without its last dim {tuple(outs.shape[:-1])}"
        )
    if not outs.is_floating_point() or not lses.is_floating_point():
        raise ValueError(f"outs and lses must be floating point, got {outs.dtype} and {lses.dtype}")
    if outs.shape[0] == 0:
        raise ValueError("cannot merge zero parts (S == 0)")
    if outs.device != lses.device:
        raise ValueError(f"outs on {outs.device} but lses on {lses.device}")


def merge_states_n(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S stacked partial states.

    Args:
        outs: [S, ..., H, D], any float dtype; part s normalised over its own keys.
        lses: [S, ..., H], natural-log LSE of each part; -inf marks an empty part.
    Returns:
        out: [..., H, D] in outs.dtype; lse: [..., H] float32, natural log.
    """
    check_states(outs, lses)
    lses32 = lses.float()
    m = lses32.amax(dim=0)  # [..., H]
    # All parts empty -> m = -inf; use 0 so that exp(-inf - 0) = 0 instead of exp(nan).
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses32 - m_safe)  # [S, ..., H]; exactly 0 for empty parts
    d = w.sum(dim=0)  # [..., H]
    # Zero the contribution of empty parts so garbage (NaN/inf) in their out cannot leak through 0 * NaN.
    wo = torch.where((w > 0).unsqueeze(-1), w.unsqueeze(-1) * outs.float(), 0.0)
    out = wo.sum(dim=0) / torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    lse = m_safe + torch.log(d)  # log(0) = -inf for all-empty rows
    return out.to(outs.dtype), lse


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states: out_* [..., H, D], lse_* [..., H] (natural log). Returns (out [..., H, D], lse fp32)."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"two-way merge needs equal shapes: out {tuple(out_a.shape)} vs {tuple(out_b.shape)}, "
            f"lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    if out_a.dtype != out_b.dtype:
        raise ValueError(f"out dtypes differ: {out_a.dtype} vs {out_b.dtype}")
    return merge_states_n(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))
