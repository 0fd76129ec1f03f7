"""Sharded-KV attention across ranks: each rank attends over its shard of a session's KV blocks, then the partial
states are merged exactly, identically on every rank (replicated weights + sharded KV, decode).

The merge is merge/reference.py's: with m = max_r lse_r and w_r = exp(lse_r - m), out = sum_r w_r out_r / sum_r w_r
and lse = m + log sum_r w_r (natural log). Every rank gathers all ranks' (out, lse) in rank order and runs the same
merge on the same bytes, so the result, and the hidden state every rank continues with, is bitwise the same on every
rank. An empty shard (a session shorter than the ranks' blocks) has lse = -inf and weighs nothing.

Layout: blocks are dealt round-robin (``block i`` lives on rank ``i % world``). A growing session then fills every
rank's shard evenly, so decode attention and the per-rank KV budget stay balanced at any length; a contiguous layout
would keep one rank busy and the others idle until its shard is full. vLLM's decode context parallel interleaves
too (by token, ``cp_kv_cache_interleave_size``); modeld deals whole pages so a rank's blocks stay pages of its pool.

Imports torch and torch.distributed only (the kernels' rule: no modeld dependencies beyond torch and triton).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import reference

LAYOUT = "round-robin by block"


def owner(block_index: int, world: int) -> int:
    """The rank that holds a session's ``block_index``-th block."""
    return block_index % world


def local_block_indices(n_blocks: int, rank: int, world: int) -> list[int]:
    """Which of a session's first n_blocks blocks (logical indices, in order) live on ``rank``."""
    return list(range(rank, n_blocks, world))


def local_tokens(n_tokens: int, block_size: int, rank: int, world: int) -> int:
    """How many of a session's first n_tokens live on ``rank`` (its shard's length)."""
    full, tail = divmod(n_tokens, block_size)
    blocks = len(local_block_indices(full, rank, world)) * block_size
    return blocks + (tail if tail and owner(full, world) == rank else 0)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of query rows over one shard's keys, as a partial state to merge (plain torch, fp32).

    q: [T, Hq, D] at absolute positions q_pos [T]; k, v: [n, Hkv, D] (n >= 0) at absolute positions k_pos [n]; a key
    is visible to a row when k_pos <= q_pos. Returns out [T, Hq, D] fp32 (0 where a row sees no key of the shard)
    and lse [T, Hq] fp32, natural log (-inf there)."""
    T, Hq, D = q.shape
    if k.shape[0] == 0:
        return q.new_zeros(T, Hq, D, dtype=torch.float32), q.new_full((T, Hq), float("-inf"), dtype=torch.float32)
    G = Hq // k.shape[1]
    kf, vf = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)     # [n, Hq, D]
    s = torch.einsum("thd,nhd->htn", q.float(), kf) * sm_scale                          # [Hq, T, n]
    s = s.masked_fill((k_pos[None, :] > q_pos[:, None])[None], float("-inf"))
    lse = torch.logsumexp(s, -1)                                                         # [Hq, T]
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
    out = torch.einsum("htn,nhd->thd", p, vf)
    return out, lse.t().contiguous()


def partial_attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                            k_pos: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention through torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
    which returns the natural-log LSE beside the output), in q's dtype, with causality by absolute position as an
    additive mask. Same shapes and meaning as partial_attention: out [T, Hq, D] in q's dtype (0 where a row sees no
    key of the shard), lse [T, Hq] fp32 (-inf there; the kernel itself reports 0 for such rows). CPU tensors only."""
    T, Hq, D = q.shape
    if k.shape[0] == 0:
        return q.new_zeros(T, Hq, D), q.new_full((T, Hq), float("-inf"), dtype=torch.float32)
    G = Hq // k.shape[1]
    visible = k_pos[None, :] <= q_pos[:, None]                                           # [T, n]
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    kk = k.to(q.dtype).repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0)             # [1, Hq, n, D]
    vv = v.to(q.dtype).repeat_interleave(G, 1).transpose(0, 1).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1).unsqueeze(0), kk, vv, 0.0, False, attn_mask=mask[None, None], scale=sm_scale)
    out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1).float()                  # [T, Hq, D], [T, Hq]
    blind = ~visible.any(1)
    if bool(blind.any()):
        out = out.masked_fill(blind[:, None, None], 0.0)
        lse = lse.masked_fill(blind[:, None], float("-inf"))
    return out, lse


def merge_across_ranks(out: torch.Tensor, lse: torch.Tensor,
                       group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's partial state and merge all of them exactly.

    Args:
        out: [..., H, D] this rank's attention over its KV shard (any float dtype; normalised over the shard).
        lse: [..., H] its natural-log LSE, -inf where the shard is empty.
        group: the process group (default: the world). Its timeout bounds the collective.
    Returns:
        out [..., H, D] in out's dtype and lse [..., H] fp32: the same bytes on every rank.
    """
    if tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(f"lse shape {tuple(lse.shape)} must equal out shape without its last dim {tuple(out.shape[:-1])}")
    world = dist.get_world_size(group)
    # one collective: out and lse packed into one fp32 buffer [..., H, D + 1]
    packed = torch.cat([out.float(), lse.float().unsqueeze(-1)], -1).contiguous()
    parts = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(parts, packed, group=group)
    stacked = torch.stack(parts)                                      # [R, ..., H, D + 1], rank order
    merged, merged_lse = reference.merge_states_n(stacked[..., :-1], stacked[..., -1])
    return merged.to(out.dtype), merged_lse
