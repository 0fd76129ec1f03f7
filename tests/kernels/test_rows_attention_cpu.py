"""cpu.c's row attention (kernels/paged_decode/cpu.py ``rows_attention``): causal prefill attention in which each
query row's bits depend only on its position, its query and its keys. Checked against fp64 causal attention (GQA
ratios, head dims, a shuffled block table, pages of one token, past and new keys across 64-key blocks, fp32 and
bf16 queries and caches), and held to the property it exists for: the same rows computed in one call, in chunks cut
anywhere, one row at a time and on any number of threads give the same bits. Where the build has no AVX2 loop
(``rows_isa`` None), the tests check that it says so and refuses."""

import pytest
import torch

from modeld_cell.kernels.paged_decode import cpu

from .utils import DTYPE_NAME

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module", autouse=True)
def built(tmp_path_factory):
    if cpu._compiler() is None:
        pytest.skip("no C compiler on PATH: the worker keeps the segmented flash calls")
    rep = cpu.load(str(tmp_path_factory.mktemp("kcache")))
    assert rep["loaded"], rep["reason"]
    return rep


@pytest.fixture
def rows(built):
    if built["rows_isa"] is None:
        assert cpu.rows_refused(9, 3, 64) is not None
        pytest.skip("this build has no row attention loop (no AVX2 + FMA): the worker keeps the segmented calls")
    return built


def paged(n, hkv, d, bs, dtype, g):
    """A pool holding n keys and values in shuffled blocks: (k_cache, v_cache, table, k, v) with k, v [n, Hkv, D] in
    key order."""
    nblk = -(-n // bs)
    kc = torch.randn(nblk + 3, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblk + 3, bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(nblk + 3, generator=g)[:nblk].to(torch.int32)
    k = kc[table.long()].reshape(-1, hkv, d)[:n]
    v = vc[table.long()].reshape(-1, hkv, d)[:n]
    return kc, vc, table, k, v


# (keys before the rows, rows, Hq, Hkv, D, BLOCK_SIZE); SmolLM2 is Hq 9 / Hkv 3 / D 64
CASES = [
    (0, 1, 9, 3, 64, 16),
    (0, 150, 9, 3, 64, 16),
    (700, 90, 9, 3, 64, 16),     # past many 64-key blocks
    (63, 66, 8, 2, 32, 1),       # one token per page, rows across a block edge
    (5, 40, 4, 4, 128, 16),      # G = 1, D 128
    (100, 30, 16, 1, 64, 32),    # G = 16, the widest group taken
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=lambda d: DTYPE_NAME[d])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=lambda d: "q" + DTYPE_NAME[d])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "past{}-T{}-Hq{}-Hkv{}-D{}-BS{}".format(*c))
def test_rows_are_causal_attention(rows, case, q_dtype, cache_dtype):
    past, t, hq, hkv, d, bs = case
    g = torch.Generator().manual_seed(past + t)
    kc, vc, table, k, v = paged(past + t, hkv, d, bs, cache_dtype, g)
    q = (torch.randn(t, hq, d, generator=g) * 2).to(q_dtype)      # * 2: peaked rows, not near-uniform ones
    got = cpu.rows_attention(q, kc, vc, table, past, 0.2)
    assert got.shape == q.shape and got.dtype == q_dtype
    want = cpu.causal_reference(q, k, v, past, 0.2)
    err = float((got.double() - want).abs().max() / want.abs().max())
    # fp32 math in another order than fp64's; a bf16 output rounds once more
    assert err <= cpu.CHECK_TOL[torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float32], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: DTYPE_NAME[d])
def test_a_row_has_the_same_bits_however_the_rows_are_cut(rows, dtype):
    """One call over 300 rows after 200 cached keys, against the same rows in chunks cut at 64-key block edges and
    off them (single rows included), on 1, 2 and 3 threads: every row equal bit for bit."""
    g = torch.Generator().manual_seed(7)
    past, t = 200, 300
    kc, vc, table, _, _ = paged(past + t, 3, 64, 16, dtype, g)
    q = torch.randn(t, 9, 64, generator=g).to(dtype)
    full = cpu.rows_attention(q, kc, vc, table, past, 0.125, threads=2)
    cuts = [0, 1, 2, 55, 56, 57, 120, 183, 184, 250, 299, 300]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        part = cpu.rows_attention(q[a:b], kc, vc, table, past + a, 0.125, threads=1 + i % 3)
        assert torch.equal(part, full[a:b]), (a, b)
    for p in (0, 57, 299):                                   # a decode step's row, alone
        assert torch.equal(cpu.rows_attention(q[p : p + 1], kc, vc, table, past + p, 0.125), full[p : p + 1])


def test_keys_past_a_row_are_never_read(rows):
    """What the cache holds after a row's own position (keys a later chunk writes, stale values of an earlier
    session) leaves the row's bits as they are: a prefill chunk sees the same numbers a cold one does."""
    g = torch.Generator().manual_seed(8)
    kc, vc, table, _, _ = paged(256, 3, 64, 16, torch.float32, g)
    q = torch.randn(100, 9, 64, generator=g)
    want = cpu.rows_attention(q, kc, vc, table, 0, 0.125)
    for blk in table[-9:].long():                             # keys 112 .. 255: past every row
        kc[blk] = float("nan")
        vc[blk] = float("inf")
    assert torch.equal(cpu.rows_attention(q, kc, vc, table, 0, 0.125), want)


def test_bad_input_is_refused_with_the_shapes(rows):
    g = torch.Generator().manual_seed(9)
    kc, vc, table, _, _ = paged(64, 3, 64, 16, torch.float32, g)
    q = torch.randn(10, 9, 64)
    with pytest.raises(ValueError, match="not covered by a block table"):
        cpu.rows_attention(q, kc, vc, table[:2], 30, 0.1)
    with pytest.raises(ValueError, match="do not match"):
        cpu.rows_attention(torch.randn(10, 9, 32), kc, vc, table, 0, 0.1)
    with pytest.raises(ValueError, match="fp32/bf16"):
        cpu.rows_attention(q.half(), kc, vc, table, 0, 0.1)
    with pytest.raises(ValueError, match="int32 block table"):
        cpu.rows_attention(q, kc, vc, table.long(), 0, 0.1)
    assert "multiple of 32" in cpu.rows_refused(9, 3, 40)
    assert "up to 16 query heads" in cpu.rows_refused(34, 2, 64)
    assert cpu.rows_refused(9, 3, 64) is None
    kc40 = torch.randn(4, 16, 3, 40)
    with pytest.raises(RuntimeError, match="returned 1"):
        cpu.rows_attention(torch.randn(10, 9, 40), kc40, kc40, table, 0, 0.1)


def test_the_build_reports_and_checks_it(rows):
    assert rows["rows_isa"] == "avx2"
    assert 0 <= rows["check"]["rows"] <= cpu.CHECK_TOL[torch.bfloat16]
