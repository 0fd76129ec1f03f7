"""Paged GQA decode: reference vs fp64 token-by-token gather, triton (split-KV) vs reference, bad input."""

import pytest
import torch

from modeld_cell.kernels.paged_decode import reference as ref

from .utils import DTYPE_NAME, TOL, assert_close, make_paged, naive_paged_decode, skip_if_interpreter_cannot

pytestmark = pytest.mark.kernels

# (seq lens, Hq, Hkv, D, BLOCK_SIZE, block_n, num_splits); SmolLM2 is Hq 9 / Hkv 3 / D 64.
CASES = [
    ([1], 4, 4, 16, 16, 16, 1),
    ([7], 9, 3, 16, 16, 16, 2),  # second split empty
    ([63, 111], 9, 3, 32, 16, 16, 3),
    ([16, 17, 32, 33], 6, 2, 16, 16, 16, 2),  # on and just past page boundaries
    ([64, 65], 8, 1, 32, 32, 64, 1),  # G = 8; a tile spans two pages
    ([0, 5], 9, 3, 16, 16, 16, 2),  # an empty sequence beside a live one
    ([0, 0], 4, 2, 16, 16, 16, 1),  # every sequence empty
    ([13, 40], 9, 3, 64, 1, 16, 2),  # one token per page
    ([111], 9, 3, 64, 16, 32, None),  # default split heuristic
    ([200, 3], 12, 3, 16, 64, 32, 4),  # splits past the short sequence's end
    ([1023, 1024, 1025], 9, 3, 64, 16, 64, 5),  # SmolLM2 heads, longer context, splits not tile-aligned
]


def case_id(c):
    lens, Hq, Hkv, D, BS, bn, S = c
    return f"B{len(lens)}-T{max(lens)}-Hq{Hq}-Hkv{Hkv}-D{D}-BS{BS}-N{bn}-S{S or 'auto'}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_vs_naive(case):
    lens, Hq, Hkv, D, BS, _, _ = case
    kc, vc, bt, sl = make_paged(lens, Hkv, D, BS)
    q = torch.randn(len(lens), Hq, D)
    scale = 0.3  # not the default, to prove sm_scale is honoured
    want_out, want_lse = naive_paged_decode(q, kc, vc, bt, sl, scale)
    out, lse = ref.paged_decode(q, kc, vc, bt, sl, sm_scale=scale, return_lse=True)
    assert_close(case_id(case) + " out", want_out, out, 1e-5, 1e-5)
    assert_close(case_id(case) + " lse", want_lse, lse, 1e-5, 1e-5)
    # without the LSE the reference takes its SDPA route
    assert_close(
        case_id(case) + " out (sdpa)", want_out, ref.paged_decode(q, kc, vc, bt, sl, sm_scale=scale), 1e-5, 1e-5
    )


@pytest.mark.parametrize("n", [1, 16, 50])
def test_reference_single_contiguous_sequence(n):
    """B = 1 with consecutive blocks is read through a view of the cache; same result as the gather."""
    kc, vc = torch.randn(8, 16, 3, 32), torch.randn(8, 16, 3, 32)
    bt = torch.tensor([[2, 3, 4, 5, -1]], dtype=torch.int32)
    sl = torch.tensor([n], dtype=torch.int32)
    q = torch.randn(1, 9, 32)
    want_out, want_lse = naive_paged_decode(q, kc, vc, bt, sl, 32**-0.5)
    out, lse = ref.paged_decode(q, kc, vc, bt, sl, return_lse=True)
    assert_close("view out", want_out, out, 1e-5, 1e-5)
    assert_close("view lse", want_lse, lse, 1e-5, 1e-5)
    assert_close("view out (sdpa)", want_out, ref.paged_decode(q, kc, vc, bt, sl), 1e-5, 1e-5)


def test_reference_default_scale_and_bf16():
    kc, vc, bt, sl = make_paged([9, 30], 3, 64, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 9, 64).bfloat16()
    want_out, want_lse = naive_paged_decode(q, kc, vc, bt, sl, 64**-0.5)
    out, lse = ref.paged_decode(q, kc, vc, bt, sl, return_lse=True)
    assert out.dtype == torch.bfloat16
    assert_close("bf16 out", want_out, out.float(), *TOL[torch.bfloat16])
    assert_close("bf16 lse", want_lse, lse, 1e-5, 1e-5)
    assert_close("bf16 out (sdpa)", want_out, ref.paged_decode(q, kc, vc, bt, sl).float(), *TOL[torch.bfloat16])


def _run_triton(case, dtype, device):
    from modeld_cell.kernels.paged_decode import triton as tri

    skip_if_interpreter_cannot(dtype, device)
    lens, Hq, Hkv, D, BS, bn, S = case
    kc, vc, bt, sl = make_paged(lens, Hkv, D, BS, dtype=dtype)
    q = torch.randn(len(lens), Hq, D).to(dtype)
    want_out, want_lse = ref.paged_decode(q, kc, vc, bt, sl, return_lse=True)
    dev = [t.to(device) for t in (q, kc, vc, bt, sl)]
    out, lse = tri.paged_decode(*dev, return_lse=True, num_splits=S, block_n=bn)
    name = f"{case_id(case)}-{DTYPE_NAME[dtype]}"
    assert out.dtype == dtype
    assert_close(name + " out", want_out.float(), out.float(), *TOL[dtype])
    assert_close(name + " lse", want_lse, lse, 1e-4, 1e-4)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.isneginf(lse[b]).all() and (out[b] == 0).all()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_vs_reference_fp32(case, device):
    _run_triton(case, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[7]], ids=case_id)
def test_triton_vs_reference_half(case, dtype, device):
    _run_triton(case, dtype, device)


def _bad_inputs():
    kc, vc, bt, sl = make_paged([20, 5], 3, 16, 16)
    q = torch.randn(2, 9, 16)
    return q, kc, vc, bt, sl


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_raises(backend):
    if backend == "torch":
        fn = ref.paged_decode
    else:
        from modeld_cell.kernels.paged_decode import triton as tri

        fn = tri.paged_decode
    q, kc, vc, bt, sl = _bad_inputs()
    bad = bt.clone()
    bad[0, 1] = kc.shape[0]  # second used block of sequence 0 points past the cache
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\].*out of range"):
        fn(q, kc, vc, bad, sl)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="out of range"):
        fn(q, kc, vc, bad, sl)
    with pytest.raises(ValueError, match="seq_lens must lie"):
        fn(q, kc, vc, bt, torch.tensor([20, bt.shape[1] * 16 + 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        fn(q, kc, vc, bt.long(), sl)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        fn(torch.randn(2, 8, 16), kc, vc, bt, sl)
    with pytest.raises(ValueError, match="must match k_cache"):
        fn(q, kc, vc[:, :8], bt, sl)
    with pytest.raises(ValueError, match="cache last dim"):
        fn(torch.randn(2, 9, 32), kc, vc, bt, sl)
    with pytest.raises(ValueError, match=r"q must be \[B, Hq, D\]"):
        fn(q[0], kc, vc, bt, sl)


def test_triton_rejects_dtype_mismatch():
    from modeld_cell.kernels.paged_decode import triton as tri

    q, kc, vc, bt, sl = _bad_inputs()
    with pytest.raises(ValueError, match="dtype"):
        tri.paged_decode(q.half(), kc, vc, bt, sl)
