"""Replicated weights + sharded KV: the model runner of one rank.

Every rank holds the full weights and runs the same forward on the same tokens, so the hidden state is identical
on every rank. The session's KV is sharded by block (kernels/merge/sharded.py: block ``i`` on rank ``i % world``):
a rank writes the K/V of the tokens whose blocks it owns and sends the others to a scratch block no one reads. Each
attention, prefill and decode alike, attends over the rank's own shard as a partial state (out, lse) with causal
masking by absolute position, and ``merge_across_ranks`` merges the ranks' partials exactly, the same bytes on every
rank. That is the prefill plan too: a chunk's rows see the earlier shards through the merge, with no K/V moved
between ranks. The cost is one all-gather of [rows, Hq, D + 1] fp32 per layer.

The block table a rank passes holds, per logical block of the session, its local block id where it owns the block
and ``SCRATCH`` elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from modeld_cell.kernels.merge import sharded
from modeld_cell.kernels.paged_prefill.reference import gather
from modeld_cell.kernels.quant_kv import reference as quant_ref
from modeld_cell.kv_cache import PagedKVCache
from modeld_cell.model import AttnMetadata, Transformer
from modeld_cell.runner import TorchRunner

SCRATCH = 0      # the local block that takes the K/V of tokens this rank does not own; never read


class RankLost(RuntimeError):
    """A collective failed: a rank died, or did not answer within the process group's timeout. The engine turns it
    into Fatal and marks itself not ready (engine._torch); the pod restarts the ranks together."""


class ShardedKVRunner(TorchRunner):
    name = "sharded-kv"

    def __init__(self, model: Transformer, kv: PagedKVCache, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model, kv)
        if kv.fmt.quant == "int4":
            raise ValueError("the sharded-KV runner reads int8 / fp8 / float caches, not packed rotated int4")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.decode_kernel = f"sharded-kv partial attention over {self.world} ranks + exact merge"

    @property
    def chunking_invariant(self) -> bool:
        return False

    def local_table(self, n_tokens: int, local_blocks: list[int]) -> list[int]:
        """The table a rank passes: its blocks (``local_blocks``, in order) where it owns the logical block, else
        SCRATCH; covers the blocks of n_tokens."""
        owned = iter(local_blocks)
        return [next(owned) if sharded.owner(i, self.world) == self.rank else SCRATCH
                for i in range(self.kv.blocks_for(n_tokens))]

    def _shard(self, k_cache: Tensor, v_cache: Tensor, scales: tuple[Tensor, Tensor] | None, table: Tensor, n: int,
               dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's cached tokens of a session with n tokens: (k, v [m, Hkv, D] in dtype, positions [m])."""
        bs, dev = self.kv.block_size, k_cache.device
        idx = sharded.local_block_indices(self.kv.blocks_for(n), self.rank, self.world)
        if not idx:
            empty = k_cache.new_zeros(0, *k_cache.shape[2:], dtype=dtype)
            return empty, empty, torch.zeros(0, dtype=torch.long, device=dev)
        phys = table[idx]
        pos = (torch.tensor(idx, device=dev)[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)
        keep = pos < n
        out = []
        for i, cache in enumerate((k_cache, v_cache)):
            vals = gather(cache, phys, len(idx) * bs)
            if scales is not None:
                vals = quant_ref.dequantize(vals, gather(scales[i], phys, len(idx) * bs))
            out.append(vals[keep].to(dtype))
        return out[0], out[1], pos[keep]

    def attend(self, q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata,
               scales: tuple[Tensor, Tensor] | None) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        outs, lses = [], []
        if meta.kind == "decode":
            for b, n in enumerate(meta.seq_lens_list):
                k, v, kp = self._shard(k_cache, v_cache, scales, meta.block_tables[b], n, q.dtype)
                o, lse = sharded.partial_attention(q[b : b + 1], k, v, torch.tensor([n - 1], device=q.device), kp,
                                                   scale)
                outs.append(o)
                lses.append(lse)
            out, lse = torch.cat(outs), torch.cat(lses)
        else:
            n = meta.seq_lens_list[0]
            t = q.shape[0]
            k, v, kp = self._shard(k_cache, v_cache, scales, meta.block_tables[0], n, q.dtype)
            out, lse = sharded.partial_attention(q, k, v, torch.arange(n - t, n, device=q.device), kp, scale)
        try:
            merged, _ = sharded.merge_across_ranks(out, lse, self.group)
        except RuntimeError as e:     # gloo / NCCL: peer gone, connection reset, or the group's timeout
            raise RankLost(f"rank {self.rank} of {self.world}: the sharded-KV merge failed: {e}") from e
        return merged.to(q.dtype)
