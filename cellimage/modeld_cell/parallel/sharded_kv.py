"""Replicated weights + sharded KV: the model runner of one rank.

Every rank holds the full weights and runs the same forward on the same tokens, so the hidden state is identical
on every rank. The session's KV is sharded by block (kernels/merge/sharded.py: block ``i`` on rank ``i % world``):
a rank writes the K/V of the tokens whose blocks it owns and sends the others to a scratch block no one reads. Each
attention, prefill and decode alike, attends over the rank's own shard as a partial state (out, lse) with causal
masking by absolute position, and ``merge_across_ranks`` merges the ranks' partials exactly, the same bytes on every
rank. That is the prefill plan too: a chunk's rows see the earlier shards through the merge, with no K/V moved
between ranks. The cost is one all-gather of [rows, Hq, D + 1] fp32 per layer.

Block ids are global (parallel/pool.ShardedPool hands them out on rank 0): id ``g`` is local block ``g // world`` of
rank ``g % world``, and the pool gives a session's block ``i`` an id of rank ``i % world``. Local block 0 of every
rank (global ids 0 .. world - 1) is the scratch block, never handed out. Every method here takes global tables and
translates them; the copy / read / write methods are this rank's part of a pool operation (parallel/ranks.py runs
them on every rank).
"""

from __future__ import annotations

import math
import time
from typing import Any

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


def global_id(local: int, rank: int, world: int) -> int:
    """The global block id of ``rank``'s local block ``local``."""
    return local * world + rank


def assemble(parts: list[list[tuple[str, Tensor]]], n: int, block_size: int) -> list[tuple[str, Tensor]]:
    """The ranks' read_local parts (rank order) back into one payload in token order: [L, n, ...] per name."""
    world = len(parts)
    names = [name for name, _ in parts[0]]
    out = []
    for j, name in enumerate(names):
        pieces, taken = [], [0] * world
        for i in range(-(-n // block_size)):
            r = sharded.owner(i, world)
            m = min(block_size, n - i * block_size)
            pieces.append(parts[r][j][1][:, taken[r] : taken[r] + m])
            taken[r] += m
        out.append((name, torch.cat(pieces, 1) if pieces else parts[0][j][1]))
    return out


def split(payload: dict[str, Tensor], n: int, block_size: int, world: int) -> list[dict[str, Tensor]]:
    """Inverse of assemble: each rank's part of a payload in token order."""
    out: list[dict[str, Tensor]] = []
    for r in range(world):
        rows = [t for i in sharded.local_block_indices(-(-n // block_size), r, world)
                for t in range(i * block_size, min(n, (i + 1) * block_size))]
        sel = torch.tensor(rows, dtype=torch.long)
        out.append({name: t.index_select(1, sel.to(t.device)).cpu() for name, t in payload.items()})
    return out


class RankRunner(TorchRunner):
    """What every rank's runner has (sharded KV, tensor, pipeline): its place in the group, and the time it spent in
    collectives and the forwards it ran, per forward kind (the capability report's communication cost). Its rows
    depend on the other ranks' sums, so it is not chunking-invariant."""

    def __init__(self, model: Transformer, kv: PagedKVCache, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(model, kv)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.collective_s = {"prefill": 0.0, "decode": 0.0}
        self.forwards = {"prefill": 0, "decode": 0}

    @property
    def chunking_invariant(self) -> bool:
        return False


class ShardedKVRunner(RankRunner):
    name = "sharded-kv"

    def __init__(self, model: Transformer, kv: PagedKVCache, group: dist.ProcessGroup | None = None) -> None:
        if kv.fmt.quant == "int4":
            raise ValueError("the sharded-KV runner reads int8 / fp8 / float caches, not packed rotated int4")
        super().__init__(model, kv, group)
        self.decode_kernel = f"sharded-kv partial attention over {self.world} ranks + exact merge"

    def choose_decode_kernel(self, mode: str) -> None:
        """Decode always runs the partial attention + merge (``attend``); MODELD_DECODE_ATTENTION does not apply."""

    def kernels(self) -> dict[str, str]:
        return {"prefill": f"sharded-kv partial attention over {self.world} ranks + exact merge (torch)",
                "decode": self.decode_kernel, "device": str(self.kv.device)}

    # ---- global tables -> this rank's

    def to_local(self, blocks: list[int]) -> list[int]:
        """A session's global block table as this rank reads it: its local id where it owns the block, else SCRATCH."""
        out = []
        for i, g in enumerate(blocks):
            r, local = g % self.world, g // self.world
            if r != sharded.owner(i, self.world) or local == SCRATCH:
                raise ValueError(f"block {i} of the session has id {g} (rank {r}, local {local}); the layout puts "
                                 f"it on rank {sharded.owner(i, self.world)} and never in a scratch block")
            out.append(local if r == self.rank else SCRATCH)
        return out

    def _owned(self, blocks: list[int], n: int) -> tuple[list[int], int]:
        """(local ids of this rank's blocks among the first n tokens', in order; how many of those tokens it holds)."""
        idx = sharded.local_block_indices(self.kv.blocks_for(n), self.rank, self.world)
        return [blocks[i] // self.world for i in idx], sharded.local_tokens(n, self.kv.block_size, self.rank,
                                                                             self.world)

    def prefill(self, tokens: list[int], start: int, blocks: list[int],
                sparse: dict | None = None) -> tuple[Tensor, float, list[dict]]:
        self.forwards["prefill"] += 1
        return super().prefill(tokens, start, self.to_local(blocks), sparse)

    def decode(self, toks: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        self.forwards["decode"] += 1
        return super().decode(toks, positions, [self.to_local(t) for t in tables])

    # ---- this rank's part of the pool's operations (global ids in, local work)

    def copy_local(self, src: int, dst: int, n: int) -> None:
        """Copy-on-write of a session's block: both ids live on the same rank (the same block index); that rank
        copies, the others do nothing."""
        if src % self.world != dst % self.world:
            raise ValueError(f"copy of block {src} into {dst}: different ranks")
        if src % self.world == self.rank:
            self.kv.copy_block(src // self.world, dst // self.world, n)

    def read_local(self, blocks: list[int], n: int) -> list[tuple[str, Tensor]]:
        """This rank's tokens among a session's first n, as stored (payload names), on the CPU."""
        local, m = self._owned(blocks, n)
        return [(name, t.cpu()) for name, t in self.kv.read_payload(local, m)]

    def write_local(self, blocks: list[int], n: int, payload: dict[str, Tensor]) -> None:
        """Inverse of read_local: this rank's part of a session's first n tokens (payload names) into its blocks."""
        local, _ = self._owned(blocks, n)
        if local:
            self.kv.write_payload(local, payload)

    def assemble(self, parts: list[list[tuple[str, Tensor]]], n: int) -> list[tuple[str, Tensor]]:
        return assemble(parts, n, self.kv.block_size)

    def split(self, payload: dict[str, Tensor], n: int) -> list[dict[str, Tensor]]:
        return split(payload, n, self.kv.block_size, self.world)

    def shape_report(self, pool: Any) -> dict[str, Any]:
        return {"shape": "sharded-kv", "layout": pool.stats()["layout"], "weights": "replicated on every rank",
                "kv_budget_bytes_per_rank": pool.local.budget_bytes, "kv_budget_bytes_total": pool.budget_bytes,
                "max_tokens_per_rank": pool.per_rank_max_tokens, "max_tokens_total": pool.max_tokens,
                "scratch_blocks_per_rank": 1,
                "collective": f"all-gather of [rows, Hq, D + 1] fp32 per layer ({self.model.args.n_layers} layers)"}

    # ---- attention

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
        # CPU: torch's flash kernel with its LSE; elsewhere the plain-torch reference (fp32)
        partial = sharded.partial_attention_flash if q.device.type == "cpu" else sharded.partial_attention
        outs, lses = [], []
        if meta.kind == "decode":
            for b, n in enumerate(meta.seq_lens_list):
                k, v, kp = self._shard(k_cache, v_cache, scales, meta.block_tables[b], n, q.dtype)
                o, lse = partial(q[b : b + 1], k, v, torch.tensor([n - 1], device=q.device), kp, scale)
                outs.append(o)
                lses.append(lse)
            out, lse = torch.cat(outs), torch.cat(lses)
        else:
            n = meta.seq_lens_list[0]
            t = q.shape[0]
            k, v, kp = self._shard(k_cache, v_cache, scales, meta.block_tables[0], n, q.dtype)
            out, lse = partial(q, k, v, torch.arange(n - t, n, device=q.device), kp, scale)
        t0 = time.perf_counter()
        try:
            merged, _ = sharded.merge_across_ranks(out, lse, self.group)
        except RuntimeError as e:     # gloo / NCCL: peer gone, connection reset, or the group's timeout
            raise RankLost(f"rank {self.rank} of {self.world}: the sharded-KV merge failed: {e}") from e
        self.collective_s["decode" if meta.kind == "decode" else "prefill"] += time.perf_counter() - t0
        return merged.to(q.dtype)
