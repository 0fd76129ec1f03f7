"""Rank 0's pool of a sharded-KV cell (parallel/pool.py): every block of a session lands on the rank the round-robin
layout names, the scratch blocks are never handed out, a short rank is an Overflow that takes nothing, eviction
takes a cached block of the right rank, and the budget the engine checks is one every allocation can meet. The K/V
payload of a session splits into the ranks' parts and back (the snapshot read and write across ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modeld_cell import errors
from modeld_cell.kernels.merge import sharded
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.parallel.pool import MirroredPool, ShardedPool
from modeld_cell.parallel.sharded_kv import assemble, split

pytestmark = pytest.mark.unit

L, HKV, D, BS = 2, 2, 8, 16


def pool(blocks_per_rank: int, world: int) -> ShardedPool:
    local = PagedKVCache(L, HKV, D, kv_format("fp32"), blocks_per_rank * BS * 2 * L * HKV * D * 4)
    return ShardedPool(local, world, SimpleNamespace())


@pytest.mark.parametrize("world", [2, 3])
def test_a_sessions_blocks_follow_the_layout_and_skip_the_scratch_blocks(world):
    p = pool(5, world)
    assert p.num_blocks == 4 * world and p.budget_bytes == p.local.budget_bytes * world
    got = p.allocate(3) + p.allocate(4, first=3)
    assert [b % world for b in got] == [sharded.owner(i, world) for i in range(7)]
    assert all(b >= world for b in got)                     # global ids 0 .. world - 1 are each rank's scratch block
    assert len(set(got)) == 7


def test_a_short_rank_is_an_overflow_that_takes_nothing():
    p = pool(3, 2)                                           # 2 usable blocks per rank
    p.allocate(2, first=0)                                   # one on each rank
    p.allocate(1, first=2)                                   # rank 0's last
    assert p.free_per_rank() == [0, 1] and p.free_blocks == 0
    with pytest.raises(errors.Overflow) as ei:
        p.allocate(2, first=3)                               # index 3 fits on rank 1, index 4 needs rank 0
    assert ei.value.details["rank"] == 0 and p.free_per_rank() == [0, 1]
    assert p.allocate(1, first=1)[0] % 2 == 1               # what rank 1 has is still there


def test_free_blocks_is_what_any_allocation_of_that_size_can_meet():
    p = pool(6, 3)
    p.allocate(4, first=0)                                   # ranks 0, 1, 2, 0
    free = p.free_per_rank()
    assert free == [3, 4, 4] and p.free_blocks == 9
    for first in range(3):                                   # any start index
        q = pool(6, 3)
        q.allocate(4, first=0)
        assert len(q.allocate(q.free_blocks, first=first)) == 9


def test_eviction_takes_a_cached_block_of_the_right_rank():
    p = pool(2, 2)                                           # one usable block per rank
    a, b = p.allocate(2)
    for blk, h in ((a, b"ha"), (b, b"hb")):
        p.index.register(blk, h, b"root", list(range(BS)))
    p.free([b, a])                                           # both cached and unreferenced; b is the older
    assert p.free_blocks == 2
    (got,) = p.allocate(1, first=2)                          # index 2: rank 0's block, though rank 1's is older
    assert got == a and got not in p.index and b in p.index


@pytest.mark.parametrize("world, n", [(2, 57), (3, 57), (3, 16), (2, 5)])
def test_a_payload_splits_into_the_ranks_parts_and_back(world, n):
    g = torch.Generator().manual_seed(n)
    payload = {"k": torch.randn(L, n, HKV, D, generator=g), "v": torch.randn(L, n, HKV, D, generator=g)}
    parts = split(payload, n, BS, world)
    for r, part in enumerate(parts):
        assert part["k"].shape[1] == sharded.local_tokens(n, BS, r, world)
    back = dict(assemble([list(p.items()) for p in parts], n, BS))
    assert torch.equal(back["k"], payload["k"]) and torch.equal(back["v"], payload["v"])


def test_rank_zeros_pools_hold_no_pages_to_release():
    """The loader hands back the start-up measurements' pages (PagedKVCache.release_pages); rank 0's bookkeeping
    pools have no tensors of their own, so there is nothing to release, and asking is no error."""
    local = PagedKVCache(L, HKV, D, kv_format("fp32"), 4 * BS * 2 * L * HKV * D * 4)
    assert pool(5, 2).release_pages() == 0
    assert MirroredPool(local, 2, SimpleNamespace(), L, HKV).release_pages() == 0
