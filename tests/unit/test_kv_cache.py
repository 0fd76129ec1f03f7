"""Paged KV cache: budget arithmetic, allocation / free, Overflow before any change, data round trip."""

from __future__ import annotations

import pytest
import torch

from modeld_cell import errors
from modeld_cell.kv_cache import PagedKVCache, kv_format

pytestmark = pytest.mark.unit

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


QD = 64  # quantized cases: int4 groups 32 values along D


@pytest.mark.parametrize("fmt,storage,vdim,stail,bpt", [
    ("int8", torch.int8, QD, (), 2 * L * HKV * (QD + 2)),
    ("fp8-e4m3", torch.float8_e4m3fn, QD, (), 2 * L * HKV * (QD + 2)),
    ("int4", torch.uint8, QD // 2, (QD // 32,), 2 * L * HKV * (QD // 2 + 2 * QD // 32)),
])
def test_quantized_layout_and_budget(fmt, storage, vdim, stail, bpt):
    kv = PagedKVCache(L, HKV, QD, kv_format(fmt), 5 * 16 * bpt + 7)
    assert kv.bytes_per_token == bpt and kv.num_blocks == 5
    assert kv.k.shape == (L, 5, 16, HKV, vdim) and kv.k.dtype == storage
    assert kv.k_scale is not None and kv.k_scale.shape == (L, 5, 16, HKV, *stail)
    assert kv.k_scale.dtype == torch.float16                           # 2 bytes per scale (docs/kernels.md)
    assert kv.k.numel() * kv.k.element_size() * 2 + kv.k_scale.numel() * 2 * 2 == kv.num_blocks * kv.block_bytes


@pytest.mark.parametrize("fmt", ["int8", "fp8-e4m3", "int4"])
def test_quantized_write_read_and_copy_on_write(fmt):
    """Writes quantize; read_tokens/read_scales + write_tokens (snapshots) and copy_block (copy-on-write) move the
    stored bytes and fp16 scales exactly; what attention reads back dequantizes close to what was written."""
    from modeld_cell.kernels.quant_kv import reference as quant_ref
    kv = PagedKVCache(L, HKV, QD, kv_format(fmt), 1 << 20)
    a, b = kv.allocate(3), kv.allocate(3)
    n = 37
    k, v = torch.randn(n, HKV, QD) * 3, torch.randn(n, HKV, QD)
    for layer in range(L):
        kv.write(layer, k * (layer + 1), v, kv.slots(a, 0, n))
    got_k, got_v = kv.read_tokens(a, n)
    scales = kv.read_scales(a, n)
    assert scales is not None and scales[0].dtype == torch.float16 and got_k.shape[:3] == (L, n, HKV)
    deq = quant_ref.dequantize(got_k[2], scales[0][2])                  # layer 2 held k * 3
    step = {"int8": 1 / 127, "fp8-e4m3": 1 / 16, "int4": 1 / 7}[fmt]
    want = k * 3
    if fmt == "int4":                                                   # stored rotated: quantize(k @ R)
        want = quant_ref.rotate(want)
        assert (quant_ref.unrotate(deq) - k * 3).pow(2).mean().sqrt() <= 0.15 * (k * 3).pow(2).mean().sqrt()
    assert (deq - want).abs().max() <= step * want.abs().max()
    kv.write_tokens(b, got_k, got_v, scales)                            # a snapshot restored elsewhere
    again_k, again_v = kv.read_tokens(b, n)
    again_s = kv.read_scales(b, n)
    assert again_s is not None
    assert torch.equal(again_k.view(torch.uint8), got_k.view(torch.uint8))
    assert torch.equal(again_v.view(torch.uint8), got_v.view(torch.uint8))
    assert torch.equal(again_s[0], scales[0]) and torch.equal(again_s[1], scales[1])
    c = kv.allocate(1)
    kv.copy_block(a[1], c[0], 5)                                        # copy-on-write of a shared tail block
    for src, dst in ((kv.k, kv.k), (kv.v, kv.v), (kv.k_scale, kv.k_scale), (kv.v_scale, kv.v_scale)):
        assert src is not None and dst is not None
        assert torch.equal(dst[:, c[0], :5].view(torch.uint8), src[:, a[1], :5].view(torch.uint8))
    with pytest.raises(ValueError, match="scales must be given"):
        kv.write_tokens(b, got_k, got_v)


def test_formats():
    assert kv_format("int4").quant == "int4"                 # stored; served where its measured smoke passes
    import modeld_api
    # the CRD's KV precisions, each by its own name, and no alias the CRD rejects
    assert {kv_format(v.value).name for v in modeld_api.KVPrecision} == {v.value for v in modeld_api.KVPrecision}
    for alias in ("fp8", "fp8_e4m3", "bfloat16"):
        with pytest.raises(errors.BadRequest):
            kv_format(alias)
    assert kv_format("int8").quantized and not kv_format("bf16").quantized
    with pytest.raises(errors.BadRequest, match=r"unknown KV precision 'fp7'") as ei:
        kv_format("fp7")
    assert ei.value.details == {"kv": "fp7"}
    with pytest.raises(errors.BadRequest):
        PagedKVCache(L, HKV, D, kv_format("fp32"), 100)   # less than one block


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_release_pages_returns_a_written_pool_to_zeros_only_while_no_block_is_held(fmt):
    """The start-up measurements write scratch blocks and free them; release_pages gives those pages back (the pool
    reads as zeros again, and its resident memory drops by what was written) and refuses while any block is
    allocated or cached."""
    kv = PagedKVCache(L, HKV, 64, kv_format(fmt), 64 << 20)
    held = kv.allocate(kv.num_blocks)
    for t in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        if t is not None:
            t.view(torch.uint8).fill_(1)                # every page written
    assert kv.release_pages() == 0                      # blocks held: nothing released
    assert kv.index.register(held[0], b"h" * 32, b"", list(range(kv.block_size)))
    kv.free(held[::-1])
    assert kv.release_pages() == 0                      # a cached block: a later request may reuse its K/V
    assert kv.clear_cache() == 1
    before = _rss_mib()
    released = kv.release_pages()
    pools = [t for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
    assert released == sum(t.numel() * t.element_size() for t in pools)
    assert before - _rss_mib() >= (released >> 20) // 2
    assert all(int(t.view(torch.uint8).max()) == 0 for t in pools)


def test_release_pages_leaves_a_device_pool_alone():
    kv = make(4)
    kv.k = kv.k.clone()                                  # not an mmap-backed pool: nothing to release
    kv.v = kv.v.clone()
    assert kv.release_pages() == 0
