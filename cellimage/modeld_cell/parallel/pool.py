"""Rank 0's block pool of a multi-rank cell: the bookkeeping of every rank's blocks, none of their tensors.

The engine's block manager, prefix index and snapshots work on this pool exactly as on a single rank's
``PagedKVCache``; what differs is where a block lives, and every K/V operation (copy-on-write, snapshot read and
write) goes to every rank through the driving runner (parallel/ranks.Driving); the forwards never touch this pool's
tensors (it has none).

``MirroredPool`` (tensor and pipeline parallel): every rank holds its KV heads, or its layers, of every block, so the ids are the same on every
rank and the bookkeeping is a single pool's.

``ShardedPool`` (sharded KV): global id ``g`` is local block ``g // world`` of rank ``g % world``
(parallel/sharded_kv.py), and ``allocate`` gives a session's block ``i`` an id of rank ``i % world`` (the
round-robin layout of kernels/merge/sharded.py). Prefix sharing and copy-on-write keep a block at its index in the
session, so a shared or copied block is always on the rank the layout names. Local block 0 of every rank is the
scratch block (global ids 0 .. world - 1) and is never handed out. Capacity: each rank has its own free blocks;
``free_blocks`` is ``world x`` the fewest free on any rank: an allocation of that many blocks at any session index
is guaranteed to succeed (it needs at most ceil(n / world) on each rank), so the engine's budget checks (Overflow
before anything changes) stay true. ``allocate`` itself checks each rank and raises Overflow, taking nothing, when
one is short.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Any

import torch
from torch import Tensor

from modeld_cell import errors
from modeld_cell.kv_cache import PagedKVCache
from modeld_cell.prefix_index import PrefixIndex

from .sharded_kv import global_id

LAYOUT = "round-robin by block (block i of a session on rank i % ranks)"


class RankPool(PagedKVCache):
    """Rank 0's pool of a multi-rank cell: the engine's bookkeeping (ids, refcounts, prefix index), none of the
    tensors. Its sizes are the whole model's (``n_kv_heads``: every KV head, as a snapshot stores them); its K/V
    operations go to every rank through the driving runner (parallel/ranks.Driving), each rank doing its part."""

    def __init__(self, local: PagedKVCache, runner: Any, world: int, n_layers: int, n_kv_heads: int,
                 budget_bytes: int) -> None:
        # no PagedKVCache.__init__: no tensors of its own
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, local.head_dim
        self.fmt, self.block_size = local.fmt, local.block_size
        self.value_dim, self.scale_tail = local.value_dim, local.scale_tail
        self.local, self.runner, self.world = local, runner, world
        self.budget_bytes = budget_bytes                              # the ranks' KV together
        self.index = PrefixIndex(self.block_size)
        self.k_scale = self.v_scale = None
        runner.pool = self

    @property
    def device(self) -> torch.device:
        return self.local.device

    def release_pages(self) -> int:
        """Nothing here: the tensors are the ranks' own pools (and a multi-rank start runs no scratch measurement)."""
        return 0

    # ---- K/V, on every rank (the driving runner runs each on the torch thread)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        self.runner.copy_block(src, dst, n)

    def read_payload(self, blocks: list[int], n: int) -> list[tuple[str, Tensor]]:
        return self.runner.read(blocks, n)

    def write_tokens(self, blocks: list[int], k: Tensor, v: Tensor,
                     scales: tuple[Tensor, Tensor] | None = None) -> None:
        if (scales is None) != (not self.fmt.quantized):
            raise ValueError(f"KV format {self.fmt.name}: scales must be given exactly for quantized formats")
        payload = {"k": k, "v": v, **({"k_scale": scales[0], "v_scale": scales[1]} if scales else {})}
        self.runner.write(blocks, k.shape[1], payload)

    def read_tokens(self, blocks: list[int], n: int) -> tuple[Tensor, Tensor]:
        got = dict(self.read_payload(blocks, n))
        return got["k"], got["v"]

    def read_scales(self, blocks: list[int], n: int) -> tuple[Tensor, Tensor] | None:
        got = dict(self.read_payload(blocks, n))
        return (got["k_scale"], got["v_scale"]) if "k_scale" in got else None


class MirroredLocal:
    """A rank runner's part of a MirroredPool's operations (tensor and pipeline parallel): the same block ids on every
    rank, each rank its own part of every block (KV heads, or layers)."""

    kv: PagedKVCache

    def copy_local(self, src: int, dst: int, n: int) -> None:
        self.kv.copy_block(src, dst, n)

    def read_local(self, blocks: list[int], n: int) -> list[tuple[str, Tensor]]:
        return [(name, t.cpu()) for name, t in self.kv.read_payload(blocks, n)]

    def write_local(self, blocks: list[int], n: int, payload: dict[str, Tensor]) -> None:
        self.kv.write_payload(blocks, payload)


class MirroredPool(RankPool):
    """Every rank holds its part (KV heads, or layers) of every block: the same ids everywhere (tensor and pipeline
    parallel), so the bookkeeping is a single pool's; sizes are the whole model's (``n_layers``, ``n_kv_heads``)."""

    def __init__(self, local: PagedKVCache, world: int, runner: Any, n_layers: int, n_kv_heads: int) -> None:
        super().__init__(local, runner, world, n_layers, n_kv_heads, local.budget_bytes * world)
        self.num_blocks = local.num_blocks
        self._free = list(range(self.num_blocks))
        heapq.heapify(self._free)
        self.ref = [0] * self.num_blocks

    def stats(self) -> dict:
        return {**super().stats(), "ranks": self.world, "layout": "every block on every rank (its part of it)",
                "per_rank_budget_bytes": self.local.budget_bytes}


class ShardedPool(RankPool):
    def __init__(self, local: PagedKVCache, world: int, runner: Any) -> None:
        if local.num_blocks < 2:
            raise errors.BadRequest(f"a sharded-KV rank needs at least 2 KV blocks (one is scratch); its budget of "
                                    f"{local.budget_bytes} bytes holds {local.num_blocks}", field="kvMemoryMiB")
        super().__init__(local, runner, world, local.n_layers, local.n_kv_heads, local.budget_bytes * world)
        self.rank_blocks = local.num_blocks - 1                       # usable blocks per rank
        self.num_blocks = self.rank_blocks * world
        self._heaps: list[list[int]] = [[global_id(i, r, world) for i in range(1, local.num_blocks)]
                                        for r in range(world)]
        self._free = []                                               # unused: free blocks are per rank (_heaps)
        self.ref = [0] * (local.num_blocks * world)

    # ---- capacity per rank

    def free_per_rank(self) -> list[int]:
        """Blocks each rank can still hand out: never used, or cached but unreferenced."""
        evictable = Counter(b % self.world for b in self.index.evictable_blocks())
        return [len(h) + evictable[r] for r, h in enumerate(self._heaps)]

    @property
    def free_blocks(self) -> int:
        return self.world * min(self.free_per_rank())

    @property
    def per_rank_max_tokens(self) -> int:
        return self.rank_blocks * self.block_size

    def allocate(self, n_blocks: int, after: int | None = None, first: int = 0) -> list[int]:
        """Blocks for a session's indices first .. first + n_blocks - 1, each on the rank the layout names
        (``after`` is ignored: a rank's shard is gathered anyway). Overflow, nothing taken, when a rank is short."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks {n_blocks} < 0")
        need = Counter(i % self.world for i in range(first, first + n_blocks))
        free = self.free_per_rank()
        short = {r: (c, free[r]) for r, c in need.items() if c > free[r]}
        if short:
            r, (c, f) = min(short.items())
            raise errors.Overflow(
                f"KV memory exhausted on rank {r}: need {c} of its blocks, {f} free of {self.rank_blocks} "
                f"({self.world} ranks, {self.free_blocks} blocks free across them)", needed_blocks=n_blocks,
                free_blocks=self.free_blocks, rank=r, block_size=self.block_size, budget_bytes=self.budget_bytes)
        out = []
        for i in range(first, first + n_blocks):
            r = i % self.world
            b = heapq.heappop(self._heaps[r]) if self._heaps[r] else self._evict_on(r)
            self.ref[b] = 1
            out.append(b)
        return out

    def _evict_on(self, rank: int) -> int:
        """The least recently used cached unreferenced block of ``rank`` (allocate checked there is one)."""
        def on_rank(block: int) -> bool:
            return block % self.world == rank
        return self.index.evict_where(on_rank)

    def _push_free(self, block: int) -> None:
        heapq.heappush(self._heaps[block % self.world], block)

    def stats(self) -> dict:
        return {**super().stats(), "ranks": self.world, "layout": LAYOUT, "per_rank_blocks": self.rank_blocks,
                "per_rank_free_blocks": self.free_per_rank(), "per_rank_budget_bytes": self.local.budget_bytes,
                "per_rank_max_tokens": self.per_rank_max_tokens}
