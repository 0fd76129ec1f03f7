"""Paged KV cache: budget arithmetic, allocation / free, Overflow before any change, data round trip."""

from __future__ import annotations

import pytest
import torch

from modeld_cell import errors
from modeld_cell.kv_cache import PagedKVCache, kv_format

pytestmark = pytest.mark.cell

L, HKV, D = 4, 2, 8


def make(budget_blocks: int, fmt: str = "fp32") -> PagedKVCache:
    bpt = 2 * L * HKV * D * kv_format(fmt).bytes_per_element
    return PagedKVCache(L, HKV, D, kv_format(fmt), budget_blocks * bpt * 16 + 7)  # +7: partial blocks don't count


@pytest.mark.parametrize("fmt,elem", [("fp32", 4), ("bf16", 2)])
def test_budget_arithmetic(fmt, elem):
    kv = make(10, fmt)
    assert kv.bytes_per_token == 2 * L * HKV * D * elem
    assert kv.block_bytes == kv.bytes_per_token * 16
    assert kv.num_blocks == 10 and kv.max_tokens == 160
    assert kv.k.shape == (L, 10, 16, HKV, D) and kv.k.dtype == kv_format(fmt).storage
    assert kv.blocks_for(0) == 0 and kv.blocks_for(16) == 1 and kv.blocks_for(17) == 2


def test_allocate_free_and_overflow_before_change():
    kv = make(6)
    a = kv.allocate(2)
    b = kv.allocate(3)
    assert len(set(a) | set(b)) == 5 and kv.free_blocks == 1 and kv.usage_ratio == pytest.approx(5 / 6)
    with pytest.raises(errors.Overflow) as ei:
        kv.allocate(2)
    assert ei.value.details["free_blocks"] == 1 and kv.free_blocks == 1   # nothing taken
    kv.free(a)
    assert kv.free_blocks == 3
    c = kv.allocate(3)
    assert sorted(c) == sorted(a + [5]) and kv.free_blocks == 0


def test_allocation_prefers_contiguous_growth():
    kv = make(8)
    s1 = kv.allocate(2)          # [0, 1]
    s2 = kv.allocate(2)          # [2, 3]
    kv.free(s1)
    grown = kv.allocate(2, after=s2[-1])
    assert grown == [4, 5]       # continues s2's run, not the lower free ids
    assert kv.allocate(1) == [0]


def test_write_read_round_trip_across_blocks():
    kv = make(4)
    blocks = kv.allocate(3)
    n = 37
    k = torch.randn(L, n, HKV, D)
    v = torch.randn(L, n, HKV, D)
    kv.write_tokens(blocks, k, v)
    k2, v2 = kv.read_tokens(blocks, n)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    slots = kv.slots(blocks, 15, 18)
    assert slots.tolist() == [blocks[0] * 16 + 15, blocks[1] * 16, blocks[1] * 16 + 1]
    kv.write(0, torch.ones(3, HKV, D), torch.zeros(3, HKV, D), slots)
    assert torch.equal(kv.k_layer(0)[blocks[1], 0], torch.ones(HKV, D))


def test_formats():
    with pytest.raises(errors.Unsupported):
        kv_format("int4")
    assert kv_format("fp8").name == kv_format("fp8_e4m3").name == "fp8-e4m3"
    assert kv_format("int8").quantized and not kv_format("bf16").quantized
    with pytest.raises(errors.BadRequest):
        kv_format("fp7")
    with pytest.raises(errors.BadRequest):
        PagedKVCache(L, HKV, D, kv_format("fp32"), 100)   # less than one block
