"""Quantized KV: format round trips, bytes per token, reference decode vs fp64, fused triton decode vs reference."""

import pytest
import torch

from modeld_cell.kernels.paged_decode import reference as paged_ref
from modeld_cell.kernels.quant_kv import reference as ref

from .utils import DTYPE_NAME, TOL, assert_close, make_paged, naive_paged_decode, rel_rms, skip_if_interpreter_cannot

pytestmark = pytest.mark.kernels

FORMATS = ["int8", "fp8", "int4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_bound(fmt):
    x = torch.randn(5, 7, 3, 64) * torch.rand(5, 7, 3, 1) * 4  # [NB, BS, Hkv, D], varied per-token magnitude
    q, scale = ref.quantize(x, fmt)
    deq = ref.dequantize(q, scale, fmt)
    assert deq.shape == x.shape and not deq.isnan().any()
    if fmt == "int8":
        assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
        bound = scale.unsqueeze(-1) / 2  # round to nearest of a step of `scale`
    elif fmt == "fp8":
        assert q.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1]
        bound = x.abs() * 2.0**-4 + scale.unsqueeze(-1) * 2.0**-9  # 3 mantissa bits; subnormal step 2^-9
    else:
        assert q.dtype == torch.uint8 and q.shape[-1] == 32 and scale.shape == (*x.shape[:-1], 2)
        bound = scale.repeat_interleave(ref.INT4_GROUP, -1) / 2
    assert ((deq - x).abs() <= bound * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_vectors_stay_zero(fmt):
    x = torch.zeros(2, 4, 1, 32)
    q, scale = ref.quantize(x, fmt)
    assert (scale == 0).all()
    assert torch.equal(ref.dequantize(q, scale, fmt), x)


def test_int4_nibble_layout():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 7.0, -7.0, 1.0  # group absmax 7 -> scale 1
    q, scale = ref.quantize(x, "int4")
    assert float(scale[0, 0]) == 1.0
    assert int(q[0, 0]) == (7 + 8) | ((-7 + 8) << 4)  # element 0 low nibble, element 1 high nibble
    assert int(q[0, 1]) == (1 + 8) | (8 << 4)


def test_bytes_per_token():
    L, Hkv, D = 30, 3, 64  # SmolLM2-135M
    assert ref.bytes_per_token("bf16", L, Hkv, D) == 2 * L * Hkv * D * 2
    assert ref.bytes_per_token("int8", L, Hkv, D) == 2 * L * Hkv * (D * 1 + 4)
    assert ref.bytes_per_token("fp8", L, Hkv, D) == ref.bytes_per_token("int8", L, Hkv, D)
    assert ref.bytes_per_token("int4", L, Hkv, D) == 2 * L * Hkv * (D // 2 + 4 * D // 32)
    with pytest.raises(ValueError, match="unknown KV format"):
        ref.bytes_per_token("int3", L, Hkv, D)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="divisible by 32"):
        ref.quantize(torch.randn(2, 48), "int4")
    with pytest.raises(ValueError, match="unknown KV format"):
        ref.quantize(torch.randn(2, 32), "int2")
    with pytest.raises(ValueError, match="float tensor"):
        ref.quantize(torch.ones(2, 32, dtype=torch.int32), "int8")


def _quant_case(lens, Hq, Hkv, D, BS, fmt, dtype=torch.float32):
    kc, vc, bt, sl = make_paged(lens, Hkv, D, BS)
    kq, ks = ref.quantize(kc, fmt)
    vq, vs = ref.quantize(vc, fmt)
    q = torch.randn(len(lens), Hq, D).to(dtype)
    return q, kc, vc, kq, vq, ks, vs, bt, sl


# (seq lens, Hq, Hkv, D, BLOCK_SIZE, block_n, num_splits)
CASES = [
    ([1, 7], 4, 4, 32, 16, 16, 1),
    ([63, 111], 9, 3, 32, 16, 16, 3),
    ([16, 17, 0], 6, 2, 32, 16, 32, 2),  # page boundary, an empty sequence
    ([40], 9, 3, 64, 8, 16, 2),
]


def case_id(c):
    lens, Hq, Hkv, D, BS, bn, S = c
    return f"B{len(lens)}-T{max(lens)}-Hq{Hq}-Hkv{Hkv}-D{D}-BS{BS}-N{bn}-S{S}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_vs_naive(case, fmt):
    lens, Hq, Hkv, D, BS, _, _ = case
    q, kc, vc, kq, vq, ks, vs, bt, sl = _quant_case(lens, Hq, Hkv, D, BS, fmt)
    kd, vd = ref.dequantize(kq, ks, fmt), ref.dequantize(vq, vs, fmt)
    want_out, want_lse = naive_paged_decode(q, kd, vd, bt, sl, D**-0.5)
    out, lse = ref.quant_paged_decode(q, kq, vq, ks, vs, bt, sl, return_lse=True)
    assert_close(f"{case_id(case)}-{fmt} out", want_out, out, 1e-5, 1e-5)
    assert_close(f"{case_id(case)}-{fmt} lse", want_lse, lse, 1e-5, 1e-5)


# Relative-RMS error of the quantized decode against full precision on N(0, 1) K/V: a sanity bound per format
# (int8 keeps about 2 decimal digits, e4m3 about 1.3, int4 about 1), not a tolerance of the kernels.
QUANT_ERROR_BOUND = {"int8": 0.02, "fp8": 0.08, "int4": 0.3}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantization_error_vs_full_precision(fmt):
    q, kc, vc, kq, vq, ks, vs, bt, sl = _quant_case([200, 77], 9, 3, 64, 16, fmt)
    full = paged_ref.paged_decode(q, kc, vc, bt, sl)
    quant = ref.quant_paged_decode(q, kq, vq, ks, vs, bt, sl)
    assert rel_rms(full, quant) < QUANT_ERROR_BOUND[fmt]


def _run_triton(case, fmt, dtype, device):
    from modeld_cell.kernels.quant_kv import triton as tri

    skip_if_interpreter_cannot(dtype, device)
    lens, Hq, Hkv, D, BS, bn, S = case
    q, _, _, kq, vq, ks, vs, bt, sl = _quant_case(lens, Hq, Hkv, D, BS, fmt, dtype)
    want_out, want_lse = ref.quant_paged_decode(q, kq, vq, ks, vs, bt, sl, return_lse=True)
    dev = [t.to(device) for t in (q, kq, vq, ks, vs, bt, sl)]
    out, lse = tri.quant_paged_decode(*dev, return_lse=True, num_splits=S, block_n=bn)
    name = f"{case_id(case)}-{fmt}-{DTYPE_NAME[dtype]}"
    atol, rtol = TOL[dtype]
    assert_close(name + " out", want_out.float(), out.float(), atol, rtol)
    assert_close(name + " lse", want_lse, lse, 1e-4 if dtype == torch.float32 else 1e-2, 1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_vs_reference_fp32(case, fmt, device):
    _run_triton(case, fmt, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_vs_reference_half(fmt, dtype, device):
    _run_triton(CASES[1], fmt, dtype, device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_raises(backend):
    if backend == "torch":
        fn = ref.quant_paged_decode
    else:
        from modeld_cell.kernels.quant_kv import triton as tri

        fn = tri.quant_paged_decode
    q, _, _, kq, vq, ks, vs, bt, sl = _quant_case([20, 5], 9, 3, 64, 16, "int8")
    with pytest.raises(ValueError, match="k_scale must be"):
        fn(q, kq, vq, ks[..., :1], vs, bt, sl)
    with pytest.raises(ValueError, match="v_scale must be"):
        fn(q, kq, vq, ks, vs.double(), bt, sl)
    with pytest.raises(ValueError, match="format fp8 stores"):
        fn(q, kq, vq, ks, vs, bt, sl, fmt="fp8")
    with pytest.raises(ValueError, match="no quantized KV format"):
        fn(q, kq.float(), vq.float(), ks, vs, bt, sl)
    bad = bt.clone()
    bad[1, 0] = 10_000
    with pytest.raises(ValueError, match="out of range"):
        fn(q, kq, vq, ks, vs, bad, sl)
    q4, _, _, kq4, vq4, ks4, vs4, bt4, sl4 = _quant_case([20], 9, 3, 64, 16, "int4")
    with pytest.raises(ValueError, match="k_scale must be"):
        fn(q4, kq4, vq4, ks4[..., 0], vs4, bt4, sl4)
