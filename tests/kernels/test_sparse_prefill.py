"""Block-sparse prefill: reference vs fp64 token mask, pattern estimate, path choice, triton vs reference."""

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
    for fn in (ref.masked_dense_attention, ref.block_sparse_attention):
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
    from modeld_cell.kernels.sparse_prefill import triton as tri

    skip_if_interpreter_cannot(dtype, device)
    T, H, Hkv, D, bs = shape
    q, k, v = _qkv(T, H, Hkv, D, dtype)
    nB = (T + bs - 1) // bs
    if mask_kind == "full":
        mask = torch.ones(H, nB, nB, dtype=torch.bool)
    elif mask_kind == "random":
        mask = _random_mask(H, T, bs, p=0.4, drop_diagonal=True)
    else:
        mask = ref.estimate_block_mask(q, k, bs, keep_ratio=0.2)
    want = ref.block_sparse_attention(q, k, v, mask, bs)
    dev = [t.to(device) for t in (q, k, v, mask)]
    out = tri.block_sparse_attention(*dev, block_size=bs)
    assert_close(f"{shape_id(shape)}-{mask_kind}-{DTYPE_NAME[dtype]}", want.float(), out.float(), *TOL[dtype])


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
