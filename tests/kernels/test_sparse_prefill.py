"""Block-sparse prefill: reference vs fp64 token mask, pattern estimate, path choice, triton vs reference; with and
without a cached past (queries at positions q0..q0+T-1 over keys 0..q0+T-1)."""

import pytest
import torch

from modeld_cell.kernels.sparse_prefill import reference as ref

from .utils import DTYPE_NAME, TOL, assert_close, naive_block_sparse, skip_if_interpreter_cannot

pytestmark = pytest.mark.kernels

# (T, H, Hkv, D, block_size); T on, just past and well off block boundaries.
SHAPES = [
    (1, 4, 4, 16, 16),
    (7, 9, 3, 16, 16),
    (63, 4, 2, 32, 16),
    (64, 9, 3, 16, 16),
    (65, 6, 2, 16, 16),
    (111, 9, 3, 32, 16),
    (111, 4, 1, 64, 32),
    (257, 9, 3, 64, 64),  # SmolLM2 heads, one token past four 64-blocks
]


def shape_id(s):
    T, H, Hkv, D, bs = s
    return f"T{T}-Hq{H}-Hkv{Hkv}-D{D}-BS{bs}"


def _qkv(T, H, Hkv, D, dtype=torch.float32):
    return torch.randn(T, H, D).to(dtype), torch.randn(T, Hkv, D).to(dtype), torch.randn(T, Hkv, D).to(dtype)


def _random_mask(H, T, bs, p=0.5, drop_diagonal=False):
    nB = (T + bs - 1) // bs
    m = torch.rand(H, nB, nB) < p
    if drop_diagonal:
        m[0].fill_diagonal_(False)  # head 0 has query rows with no kept key at all -> zeros
    return m


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_reference_vs_naive(shape):
    T, H, Hkv, D, bs = shape
    q, k, v = _qkv(T, H, Hkv, D)
    mask = _random_mask(H, T, bs, drop_diagonal=True)
    want = naive_block_sparse(q, k, v, mask, bs, D**-0.5)
    for fn in (ref.masked_dense_attention, ref.block_sparse_attention, ref.block_sparse_gather_attention):
        name = f"{shape_id(shape)} {fn.__name__}"
        assert_close(name, want, fn(q, k, v, mask, bs), 1e-5, 1e-5)
        # chunking over query blocks must not change anything
        assert_close(name + " chunked", want, fn(q, k, v, mask, bs, max_chunk_elems=1), 1e-5, 1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_full_mask_equals_dense_sdpa(shape):
    T, H, Hkv, D, bs = shape
    q, k, v = _qkv(T, H, Hkv, D)
    nB = (T + bs - 1) // bs
    full = torch.ones(H, nB, nB, dtype=torch.bool)
    dense = ref.dense_causal_attention(q, k, v)
    assert_close(shape_id(shape), naive_block_sparse(q, k, v, full, bs, D**-0.5), dense, 1e-5, 1e-5)
    assert_close(shape_id(shape), dense, ref.block_sparse_attention(q, k, v, full, bs), 1e-5, 1e-5)
    assert_close(shape_id(shape), dense, ref.masked_dense_attention(q, k, v, full, bs), 1e-5, 1e-5)


def test_estimate_structure_and_knobs():
    T, H, Hkv, D, bs = 300, 6, 2, 16, 16
    q, k, _ = _qkv(T, H, Hkv, D)
    nB = (T + bs - 1) // bs
    m = ref.estimate_block_mask(q, k, bs, keep_ratio=0.1)
    assert m.shape == (H, nB, nB) and m.dtype == torch.bool
    assert not m.triu(1).any(), "kept blocks above the diagonal"
    assert m[:, :, 0].all(), "sink block dropped"
    idx = torch.arange(nB)
    assert m[:, idx, idx].all() and m[:, idx[1:], idx[:-1]].all(), "local blocks dropped"
    dens = [ref.block_density(ref.estimate_block_mask(q, k, bs, keep_ratio=r)) for r in (0.05, 0.2, 0.5, 1.0)]
    assert dens == sorted(dens) and dens[-1] == 1.0
    assert ref.block_density(m) < 1.0
    with pytest.raises(ValueError, match="keep_ratio"):
        ref.estimate_block_mask(q, k, bs, keep_ratio=0.0)


def test_estimate_cap_bounds_kept_blocks_as_context_grows():
    """keep_ratio is capped at max_keep_tokens per pattern kind: the vertical picks per head never exceed the cap, and
    the kept fraction falls with the length (a fixed budget, as MInference keeps), while without the cap it does not."""
    H, Hkv, D, bs = 2, 1, 16, 16
    dens, uncapped = [], []
    for T in (512, 1024, 2048):
        q, k, _ = _qkv(T, H, Hkv, D)
        m = ref.estimate_block_mask(q, k, bs, keep_ratio=0.1, max_keep_tokens=64, dense_last_block=False)
        first = m[:, : -3]  # query blocks whose kept set is the sink, 2 local, <= 4 verticals and <= 4 diagonals x 2
        assert int(first.sum(-1).max()) <= 1 + 2 + 4 + 2 * 4
        dens.append(ref.block_density(m))
        uncapped.append(ref.block_density(ref.estimate_block_mask(q, k, bs, keep_ratio=0.1, max_keep_tokens=None)))
    assert dens[0] > dens[1] > dens[2], dens
    assert min(uncapped) > dens[2] * 1.5, (uncapped, dens)
    q, k, _ = _qkv(64, H, Hkv, D)
    with pytest.raises(ValueError, match="max_keep_tokens"):
        ref.estimate_block_mask(q, k, bs, max_keep_tokens=bs - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAME.get)
def test_flash_path_matches_fp32_gather_in_half_precision(dtype):
    """The CPU production path computes in the inputs' dtype (a bf16 cell's): within that dtype's tolerance of the
    fp32 gather path, fresh and after an unaligned past, with heads that drop their diagonal blocks."""
    for q0, T in ((0, 300), (77, 200)):
        q, k, v = _qkv_past(q0, T, 9, 3, 64) if q0 else _qkv(T, 9, 3, 64)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        _, nQB, nKB = ref.block_grid(T, q0 + T, 16)
        mask = torch.rand(9, nQB, nKB) < 0.3
        mask[0] = False
        mask[1, :, -1] = False
        want = ref.block_sparse_gather_attention(q, k, v, mask, 16)
        got = ref.block_sparse_attention(q, k, v, mask, 16, max_chunk_elems=1 << 14)
        assert got.dtype == dtype
        assert_close(f"{DTYPE_NAME[dtype]} q0={q0}", want.float(), got.float(), *TOL[dtype])
        assert not got[:, 0].float().abs().sum(), "a head that keeps nothing must give zeros"


def test_estimate_finds_planted_vertical_and_slash():
    T, H, D, bs, lag = 256, 2, 32, 16, 40
    k = torch.nn.functional.normalize(torch.randn(T, 1, D), dim=-1) * 3
    q = torch.randn(T, H, D) * 0.01
    q[:, 0] += 8 * k[37, 0]  # head 0: every query looks at key 37 (key block 2) -> vertical
    q[lag:, 1] += 8 * k[:-lag, 0]  # head 1: query t looks at key t - 40 -> a slash at block offset 2
    m = ref.estimate_block_mask(q, k, bs, vertical_topk=1, slash_topk=1, local_blocks=1)
    nB = T // bs
    assert m[0, 2:, 2].all(), "vertical key block 2 not kept for head 0"
    for qb in range(4, nB):  # offset 40 = block offset 2, crossing key blocks qb - 2 and qb - 3
        assert m[1, qb, qb - 2] and m[1, qb, qb - 3], f"slash blocks of query block {qb} not kept for head 1"


def test_choose_path():
    assert ref.choose_path(1000) == "dense"
    assert ref.choose_path(ref.DENSE_BELOW_TOKENS) == "sparse"
    assert ref.choose_path(32768, density=0.7) == "dense"
    assert ref.choose_path(32768, density=0.3) == "sparse"
    assert ref.choose_path(2048, density=0.1, min_tokens=1024) == "sparse"


def test_mask_to_kv_indices():
    m = torch.zeros(1, 4, 4, dtype=torch.bool)
    m[0, 3, [0, 2, 3]] = True
    m[0, 1, [1, 3]] = True  # block 3 is above the diagonal of query block 1: dropped
    idx, cnt = ref.mask_to_kv_indices(m)
    assert cnt.tolist() == [[0, 1, 0, 3]]
    assert idx[0, 3].tolist() == [0, 2, 3] and idx[0, 1, 0] == 1
    assert idx.dtype == cnt.dtype == torch.int32


def test_bad_input_raises():
    q, k, v = _qkv(40, 9, 3, 16)
    with pytest.raises(ValueError, match="block_mask must be bool"):
        ref.block_sparse_attention(q, k, v, torch.ones(9, 2, 2, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ref.dense_causal_attention(q[:, :8], k, v)
    with pytest.raises(ValueError, match="same shape"):
        ref.block_sparse_attention(q, k, v[:, :1], torch.ones(9, 3, 3, dtype=torch.bool), 16)


def _run_triton(shape, mask_kind, dtype, device):
    """A fresh prefill is the no-past case of _run_triton_past (the same q/k/v draws and masks)."""
    _run_triton_past((0, *shape), mask_kind, dtype, device)


@pytest.mark.parametrize("mask_kind", ["full", "random", "estimate"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_triton_vs_reference_fp32(shape, mask_kind, device):
    _run_triton(shape, mask_kind, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[5]], ids=shape_id)
def test_triton_vs_reference_half(shape, dtype, device):
    _run_triton(shape, "random", dtype, device)


def test_triton_kv_indices_reuse_and_errors(device):
    from modeld_cell.kernels.sparse_prefill import triton as tri

    T, H, Hkv, D, bs = 50, 4, 2, 16, 16
    q, k, v = (t.to(device) for t in _qkv(T, H, Hkv, D))
    mask = _random_mask(H, T, bs).to(device)
    a = tri.block_sparse_attention(q, k, v, mask, bs)
    b = tri.block_sparse_attention(q, k, v, block_size=bs, kv_indices=ref.mask_to_kv_indices(mask))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="power of two"):
        tri.block_sparse_attention(q, k, v, mask, 24)
    with pytest.raises(ValueError, match="kv_indices must be"):
        tri.block_sparse_attention(q, k, v, block_size=bs, kv_indices=(torch.zeros(1, 1, 1, dtype=torch.int32),) * 2)


# ---- with a cached past: q [T, H, D] at positions q0..q0+T-1, k/v [q0+T, Hkv, D]

# (q0, T, H, Hkv, D, block_size): q0 = 0, a multiple of the block and not; odd T; a chunk inside one block; GQA 1-4.
PAST_SHAPES = [
    (0, 65, 6, 2, 16, 16),
    (32, 33, 9, 3, 16, 16),
    (37, 63, 4, 2, 32, 16),
    (5, 1, 4, 1, 16, 16),
    (64, 7, 8, 8, 16, 16),
    (100, 111, 9, 3, 32, 32),
    (130, 127, 9, 3, 64, 64),  # SmolLM2 heads, past and chunk both off the 64-block grid
]


def past_id(s):
    q0, T, H, Hkv, D, bs = s
    return f"P{q0}-T{T}-Hq{H}-Hkv{Hkv}-D{D}-BS{bs}"


def _qkv_past(q0, T, H, Hkv, D, dtype=torch.float32):
    S = q0 + T
    return torch.randn(T, H, D).to(dtype), torch.randn(S, Hkv, D).to(dtype), torch.randn(S, Hkv, D).to(dtype)


def _random_past_mask(H, T, S, bs, p=0.5, drop_diagonal=False):
    qb0, nQB, nKB = ref.block_grid(T, S, bs)
    m = torch.rand(H, nQB, nKB) < p
    if drop_diagonal:
        m[0, torch.arange(nQB), qb0 + torch.arange(nQB)] = False  # head 0: rows with no kept key at all -> zeros
    return m


def naive_with_past(q, k, v, block_mask, bs, scale):
    """fp64 oracle: the [T, T] token-mask computation of utils.naive_block_sparse over the whole sequence (random
    queries stand in for the past rows, whose outputs are dropped), the mask's rows placed at their absolute blocks."""
    T, H, D = q.shape
    S = k.shape[0]
    qb0, _, nKB = ref.block_grid(T, S, bs)
    full = torch.ones(H, nKB, nKB, dtype=torch.bool)
    full[:, qb0:] = block_mask
    q_all = torch.cat([torch.randn(S - T, H, D, dtype=q.dtype), q])
    return naive_block_sparse(q_all, k, v, full, bs, scale)[S - T :]


def dense_fp64(q, k, v, scale):
    """fp64 dense causal attention of the last T positions over all S keys. Returns out [T, H, D]."""
    T, H, _ = q.shape
    S, Hkv = k.shape[:2]
    kk = k.double().repeat_interleave(H // Hkv, 1)  # [S, H, D]
    vv = v.double().repeat_interleave(H // Hkv, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    causal = torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None]  # [T, S]
    return torch.einsum("hts,shd->thd", torch.softmax(s.masked_fill(~causal, float("-inf")), -1), vv)


@pytest.mark.parametrize("shape", PAST_SHAPES, ids=past_id)
def test_reference_with_past_vs_naive(shape):
    q0, T, H, Hkv, D, bs = shape
    q, k, v = _qkv_past(q0, T, H, Hkv, D)
    mask = _random_past_mask(H, T, q0 + T, bs, drop_diagonal=True)
    want = naive_with_past(q, k, v, mask, bs, D**-0.5)
    for fn in (ref.masked_dense_attention, ref.block_sparse_attention, ref.block_sparse_gather_attention):
        name = f"{past_id(shape)} {fn.__name__}"
        assert_close(name, want, fn(q, k, v, mask, bs), 1e-5, 1e-5)
        assert_close(name + " chunked", want, fn(q, k, v, mask, bs, max_chunk_elems=1), 1e-5, 1e-5)


@pytest.mark.parametrize("shape", PAST_SHAPES, ids=past_id)
def test_full_mask_with_past_equals_dense(shape):
    """Keeping every block must be dense causal attention over past + new (fp64 oracle), and so must the estimate at
    keep_ratio 1.0 and the SDPA dense path (row-chunked or not)."""
    q0, T, H, Hkv, D, bs = shape
    q, k, v = _qkv_past(q0, T, H, Hkv, D)
    want = dense_fp64(q, k, v, D**-0.5)
    _, nQB, nKB = ref.block_grid(T, q0 + T, bs)
    full = torch.ones(H, nQB, nKB, dtype=torch.bool)
    est = ref.estimate_block_mask(q, k, bs, keep_ratio=1.0)
    assert est.shape == full.shape and ref.block_density(est) == 1.0
    name = past_id(shape)
    assert_close(name + " sparse", want, ref.block_sparse_attention(q, k, v, est, bs), 1e-5, 1e-5)
    assert_close(name + " masked", want, ref.masked_dense_attention(q, k, v, full, bs), 1e-5, 1e-5)
    assert_close(name + " sdpa", want, ref.dense_causal_attention(q, k, v), 1e-5, 1e-5)
    assert_close(name + " sdpa rows", want, ref.dense_causal_attention(q, k, v, max_chunk_elems=1), 1e-5, 1e-5)


@pytest.mark.parametrize("kind", ["empty", "sink-only-head0"])
def test_empty_masks_with_past_never_nan(kind, device):
    """No kept key gives exact zeros (never NaN) in both references and the triton kernel."""
    from modeld_cell.kernels.sparse_prefill import triton as tri

    q0, T, H, Hkv, D, bs = 37, 50, 4, 2, 16, 16
    q, k, v = _qkv_past(q0, T, H, Hkv, D)
    _, nQB, nKB = ref.block_grid(T, q0 + T, bs)
    mask = torch.zeros(H, nQB, nKB, dtype=torch.bool)
    if kind == "sink-only-head0":
        mask[0, :, 0] = True
    want = naive_with_past(q, k, v, mask, bs, D**-0.5)
    outs = {"masked": ref.masked_dense_attention(q, k, v, mask, bs), "sparse": ref.block_sparse_attention(q, k, v, mask, bs),
            "triton": tri.block_sparse_attention(*(t.to(device) for t in (q, k, v, mask)), block_size=bs)}  # fmt: skip
    for name, out in outs.items():
        assert_close(f"{kind} {name}", want, out, 1e-5, 1e-5)
        assert not out[:, 1:].float().abs().sum() and (kind == "empty") == (not out.float().abs().sum())


def test_estimate_with_past_structure_and_knobs():
    q0, T, H, Hkv, D, bs = 203, 97, 6, 2, 16, 16
    q, k, _ = _qkv_past(q0, T, H, Hkv, D)
    qb0, nQB, nKB = ref.block_grid(T, q0 + T, bs)
    assert (qb0, nQB, nKB) == (12, 7, 19)
    m = ref.estimate_block_mask(q, k, bs, keep_ratio=0.1)
    assert m.shape == (H, nQB, nKB) and m.dtype == torch.bool
    assert not (m & ~torch.ones(nQB, nKB, dtype=torch.bool).tril(qb0)).any(), "kept blocks right of the diagonal"
    assert m[:, :, 0].all(), "sink block dropped"
    r = torch.arange(nQB)
    assert m[:, r, qb0 + r].all() and m[:, r, qb0 + r - 1].all(), "local blocks dropped"
    dens = [ref.block_density(ref.estimate_block_mask(q, k, bs, keep_ratio=x)) for x in (0.05, 0.2, 0.5, 1.0)]
    assert dens == sorted(dens) and dens[-1] == 1.0 and dens[0] < 0.5


def test_estimate_with_past_finds_planted_patterns_past_the_sink():
    """A vertical far back in the past and a slash reaching into it are found even though the sink block carries
    most of the mass (as in real models): the top picks skip blocks the sink and local blocks already hold."""
    q0, T, H, D, bs, lag = 192, 64, 2, 32, 16, 100
    S = q0 + T
    k = torch.nn.functional.normalize(torch.randn(S, 1, D), dim=-1) * 3
    q = torch.randn(T, H, D) * 0.01 + 10 * k[0, 0]  # every query looks hardest at key 0 (the sink)
    q[:, 0] += 8 * k[37, 0]  # head 0: every query also looks at key 37 (key block 2) -> vertical
    q[:, 1] += 8 * k[q0 - lag : S - lag, 0]  # head 1: query t looks at key t - 100 -> slash at block offset 6
    m = ref.estimate_block_mask(q, k, bs, vertical_topk=1, slash_topk=1, local_blocks=2)
    qb0, nQB, _ = ref.block_grid(T, S, bs)
    assert m[0, :, 2].all(), "vertical key block 2 not kept for head 0"
    for r in range(nQB):  # offset 100 = block offset 6, crossing key blocks qb - 6 and qb - 7
        qb = qb0 + r
        assert m[1, r, qb - 6] and m[1, r, qb - 7], f"slash blocks of query block {qb} not kept for head 1"


def test_choose_path_with_past():
    assert ref.choose_path(300, past=5000) == "sparse"  # 5300 keys
    assert ref.choose_path(3000, past=500) == "dense"  # 3500 keys < 4096
    assert ref.choose_path(ref.DENSE_BELOW_QUERIES - 1, past=10_000) == "dense"  # estimate ~ as dear as dense
    assert ref.choose_path(1000, density=0.7, past=10_000) == "dense"
    assert ref.choose_path(1000, density=0.1, past=10_000) == "sparse"


def test_mask_to_kv_indices_with_past():
    m = torch.ones(1, 2, 5, dtype=torch.bool)  # query blocks 3 and 4 over key blocks 0..4
    m[0, 0, 1] = False
    idx, cnt = ref.mask_to_kv_indices(m)
    assert cnt.tolist() == [[3, 5]]  # block 4 is right of query block 3's diagonal: dropped
    assert idx[0, 0, :3].tolist() == [0, 2, 3] and idx[0, 1].tolist() == [0, 1, 2, 3, 4]
    assert ref.block_density(m) == 8 / 9


def test_bad_input_with_past_raises():
    q, k, v = _qkv_past(20, 40, 9, 3, 16)
    with pytest.raises(ValueError, match=r"nQB=3, nKB=4"):
        ref.block_sparse_attention(q, k, v, torch.ones(9, 3, 3, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="S >= T"):
        ref.block_sparse_attention(q, k[:30], v[:30], torch.ones(9, 2, 2, dtype=torch.bool), 16)


def test_dispatch_sparse_prefill_with_past():
    from modeld_cell.kernels import dispatch

    q, k, v = _qkv_past(500, 300, 4, 2, 16)
    out, info = dispatch.sparse_prefill(q, k, v, block_size=16, keep_ratio=0.05, min_tokens=0, return_info=True)
    assert info["path"] == "sparse" and 0 < info["density"] <= 0.6
    mask = ref.estimate_block_mask(q, k, 16, keep_ratio=0.05)
    assert_close("sparse", ref.block_sparse_attention(q, k, v, mask, 16), out, 1e-6, 1e-6)
    out, info = dispatch.sparse_prefill(q, k, v, block_size=16, min_tokens=1000, return_info=True)
    assert info["path"] == "dense"  # 800 keys
    assert_close("dense", dense_fp64(q, k, v, 16**-0.5), out, 1e-5, 1e-5)


def _run_triton_past(shape, mask_kind, dtype, device):
    from modeld_cell.kernels.sparse_prefill import triton as tri

    skip_if_interpreter_cannot(dtype, device)
    q0, T, H, Hkv, D, bs = shape
    q, k, v = _qkv_past(q0, T, H, Hkv, D, dtype)
    _, nQB, nKB = ref.block_grid(T, q0 + T, bs)
    if mask_kind == "full":
        mask = torch.ones(H, nQB, nKB, dtype=torch.bool)
    elif mask_kind == "random":
        mask = _random_past_mask(H, T, q0 + T, bs, p=0.4, drop_diagonal=True)
    else:
        mask = ref.estimate_block_mask(q, k, bs, keep_ratio=0.2)
    want = ref.block_sparse_attention(q, k, v, mask, bs)
    out = tri.block_sparse_attention(*(t.to(device) for t in (q, k, v, mask)), block_size=bs)
    assert_close(f"{past_id(shape)}-{mask_kind}-{DTYPE_NAME[dtype]}", want.float(), out.float(), *TOL[dtype])


@pytest.mark.parametrize("mask_kind", ["full", "random", "estimate"])
@pytest.mark.parametrize("shape", PAST_SHAPES, ids=past_id)
def test_triton_with_past_vs_reference_fp32(shape, mask_kind, device):
    _run_triton_past(shape, mask_kind, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("shape", [PAST_SHAPES[2], PAST_SHAPES[5]], ids=past_id)
def test_triton_with_past_vs_reference_half(shape, dtype, device):
    _run_triton_past(shape, "random", dtype, device)


def test_triton_with_past_kv_indices(device):
    from modeld_cell.kernels.sparse_prefill import triton as tri

    q, k, v = (t.to(device) for t in _qkv_past(37, 50, 4, 2, 16))
    mask = _random_past_mask(4, 50, 87, 16).to(device)
    a = tri.block_sparse_attention(q, k, v, mask, 16)
    b = tri.block_sparse_attention(q, k, v, block_size=16, kv_indices=ref.mask_to_kv_indices(mask))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"nQB=4"):
        tri.block_sparse_attention(q, k, v, block_size=16, kv_indices=ref.mask_to_kv_indices(mask[:, 1:]))
