"""The CPU paged-decode kernel (kernels/paged_decode/cpu.c, built with this machine's C compiler) against the torch
reference: GQA ratios, head dims on and off the AVX-512 loop, page boundaries, shuffled tables, fp32 / bf16 caches
and queries; its build cache; bad input; and a build or check that fails leaving it off with the reason."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeld_cell.kernels.paged_decode import cpu
from modeld_cell.kernels.paged_decode import reference as ref

from .utils import DTYPE_NAME, TOL, assert_close, make_paged

pytestmark = pytest.mark.kernels

# (seq lens, Hq, Hkv, D, BLOCK_SIZE); SmolLM2 is Hq 9 / Hkv 3 / D 64.
CASES = [
    ([1], 4, 4, 16, 16),
    ([7, 63, 111], 9, 3, 64, 16),
    ([16, 17, 32, 33], 6, 2, 32, 16),  # on and just past page boundaries
    ([65], 8, 1, 64, 32),  # G = 8, the AVX-512 loop's widest group
    ([40], 12, 1, 16, 16),  # G = 12: past it, the portable loop
    ([13, 40], 9, 3, 64, 1),  # one token per page
    ([50], 4, 2, 48, 16),  # D 48: three 16-lane vectors
    ([50], 4, 2, 40, 16),  # D 40: the portable loop
    ([1023, 1025], 9, 3, 64, 16),
    ([300], 16, 4, 128, 16),  # Hq x D 2048: the widest the AVX2 16-element loop takes
    ([300], 32, 8, 128, 16),  # Hq x D 4096: past it, AVX2's 8-element loop
    ([2, 21], 7, 7, 16, 8),  # G = 1, short blocks: a key group's tail of 1-3 keys
]


def case_id(c):
    lens, Hq, Hkv, D, BS = c
    return f"B{len(lens)}-T{max(lens)}-Hq{Hq}-Hkv{Hkv}-D{D}-BS{BS}"


@pytest.fixture(scope="module", autouse=True)
def built(tmp_path_factory):
    """The kernel built into a fresh cache and loaded; skipped only where this machine has no C compiler (where
    the worker serves the flash call instead, saying so)."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler on PATH: the worker leaves the CPU kernel off")
    rep = cpu.load(str(tmp_path_factory.mktemp("kcache")))
    assert rep["loaded"], rep["reason"]
    return rep


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=lambda d: DTYPE_NAME[d])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=lambda d: "q" + DTYPE_NAME[d])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_vs_reference(case, q_dtype, cache_dtype):
    lens, Hq, Hkv, D, BS = case
    kc, vc, bt, sl = make_paged(lens, Hkv, D, BS, dtype=cache_dtype)
    q = (torch.randn(len(lens), Hq, D) * 2).to(q_dtype)      # * 2: peaked softmax rows, not near-uniform ones
    scale = 0.3
    want = ref.paged_decode(q.float(), kc.float(), vc.float(), bt, sl, sm_scale=scale)
    got = cpu.paged_decode(q, kc, vc, bt, sl, sm_scale=scale)
    assert got.shape == q.shape and got.dtype == q_dtype
    atol, rtol = TOL[torch.bfloat16 if torch.bfloat16 in (q_dtype, cache_dtype) else torch.float32]
    assert_close(case_id(case), want, got.float(), atol, rtol)


def test_the_op_reads_the_cache_in_place_and_leaves_it_untouched():
    """torch.ops.modeld.paged_decode_cpu, as the scripted step calls it: one row, its 1-D table, n keys; the cache is
    read where it lies (no copy is handed in) and not written."""
    kc, vc, bt, sl = make_paged([70], 3, 64, 16, dtype=torch.bfloat16)
    before = (kc.clone(), vc.clone())
    q = torch.randn(1, 9, 64).to(torch.bfloat16)
    out = torch.ops.modeld.paged_decode_cpu(q, kc, vc, bt[0], 70, 0.125)
    want = ref.paged_decode(q.float(), kc.float(), vc.float(), bt, sl, sm_scale=0.125)
    assert_close("op", want, out.float(), *TOL[torch.bfloat16])
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_bad_input_is_refused_with_the_shapes():
    kc, vc, bt, _ = make_paged([20], 2, 16, 16)
    q = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="is not covered by a block table"):
        torch.ops.modeld.paged_decode_cpu(q, kc, vc, bt[0, :1], 20, 0.25)
    with pytest.raises(ValueError, match="do not match q"):
        torch.ops.modeld.paged_decode_cpu(torch.randn(1, 4, 32), kc, vc, bt[0], 20, 0.25)
    with pytest.raises(ValueError, match="fp32/bf16"):
        torch.ops.modeld.paged_decode_cpu(q, kc.half(), vc.half(), bt[0], 20, 0.25)
    with pytest.raises(ValueError, match="int32 block table"):
        torch.ops.modeld.paged_decode_cpu(q, kc, vc, bt[0].long(), 20, 0.25)
    with pytest.raises(RuntimeError, match="a head shape it does not take"):
        torch.ops.modeld.paged_decode_cpu(torch.randn(1, 3, 16), kc, vc, bt[0], 20, 0.25)     # Hq 3, Hkv 2


def test_the_build_is_cached_by_source_compiler_and_cpu(tmp_path, monkeypatch):
    """A second start finds the library built (no compile); it lives under the cache given."""
    monkeypatch.setattr(cpu, "_lib", cpu._lib)          # _load replaces the loaded library: restore it after
    first = cpu._load(str(tmp_path))
    again = cpu._load(str(tmp_path))
    assert first["loaded"] and again["loaded"] and first["library"] == again["library"]
    assert again["built_s"] == 0.0 and first["library"].startswith(str(tmp_path / "kernels"))
    assert len(list((tmp_path / "kernels").glob("paged_decode_cpu-*.so"))) == 1


def test_loading_it_leaves_the_processs_floating_point_as_it_was(tmp_path):
    """Built with -ffast-math given to the link, gcc added crtfastmath.o, and loading the library turned on
    flush-to-zero for the whole worker: every torch op after it lost its subnormals. A fresh interpreter (nothing
    loaded before) keeps a subnormal through a multiply after loading a fresh build."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler on PATH")
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); "
            "from modeld_cell.kernels.paged_decode import cpu; "
            "rep = cpu.load(sys.argv[2]); assert rep['loaded'], rep['reason']; "
            "x = torch.tensor([1e-40]) * 1.0; print(float(x[0]) > 0)")
    out = subprocess.run([sys.executable, "-c", code, str(Path(cpu.__file__).parents[3]), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_a_failed_build_or_check_leaves_the_kernel_off_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_lib", cpu._lib)
    monkeypatch.setenv("CC", "false")                      # a compiler that fails
    rep = cpu._load(str(tmp_path))
    assert not rep["loaded"] and "could not build cpu.c" in rep["reason"]
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    assert cpu._load(str(tmp_path))["reason"].startswith("no C compiler on PATH")
    monkeypatch.delenv("CC")
    blocked = tmp_path / "file"                            # a cache root that cannot be a directory
    blocked.write_text("")
    rep = cpu._load(str(blocked))
    assert not rep["loaded"] and rep["reason"].startswith(f"building into {blocked / 'kernels'} failed")

    def wrong() -> dict:
        raise AssertionError("float32 Hq=9 Hkv=3 D=64 n=77: relative error 0.5 over 0.0001")

    monkeypatch.setattr(cpu, "self_check", wrong)
    rep = cpu._load(str(tmp_path))
    assert not rep["loaded"] and "failed its check against the reference" in rep["reason"] and not cpu.loaded()


# ---- the whole-layer decode step's row linear (cpu.c's gemv: 16-row groups, 32/16-element steps, a masked tail)

GEMV_SHAPES = [(1, 1), (15, 31), (16, 32), (17, 33), (48, 576), (960, 576), (5, 1536), (49, 19)]


@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: DTYPE_NAME[d])
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_the_row_linear_is_the_matrix_vector_product(shape, dtype, threads):
    """Against fp64 on the same bf16/fp32 inputs: rows off and on its 16-row groups and split over threads (a share
    may be empty), K off and on its steps; the portable loop too. Every row written, none past N."""
    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(k, generator=g).to(dtype)
    want = w.double() @ x.double()
    atol, rtol = TOL[dtype]
    for portable in (False, True):
        got = cpu.gemv(w, x, portable=portable, threads=threads)
        assert got.shape == (n,) and got.dtype == torch.float32
        assert_close(f"gemv portable={portable}", want.float(), got, atol, rtol)


def test_the_row_linear_refuses_what_it_cannot_multiply():
    with pytest.raises(ValueError, match="one dtype"):
        cpu.gemv(torch.randn(4, 8), torch.randn(8).bfloat16())
    with pytest.raises(ValueError, match=r"w \[N, K\] and x \[K\]"):
        cpu.gemv(torch.randn(4, 8), torch.randn(9))
    with pytest.raises(ValueError, match="fp32/bf16"):
        cpu.gemv(torch.randn(4, 8).half(), torch.randn(8).half())


# ---- the layer step's Q4_1 row linear (cpu.c's gemv_q4: two rows at a time, 32-weight groups)

Q4_SHAPES = [(1, 32), (2, 32), (3, 64), (17, 96), (48, 576), (960, 576), (5, 1536)]


def _x16_bound(wq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The most a quantized row linear may be off per row: the AVX2 loops hold x in 16-bit fixed point per 32-group
    (each value within max |x_group| / 65534 of itself) against the codes' part of the weights ``wq`` [N, K], plus
    fp32 summation's rounding (a few ulps of the products' magnitudes)."""
    n, k = wq.shape
    step = x.view(-1, 32).abs().amax(1).double() / 65534                          # [K/32]
    codes = (wq.double().abs().view(n, -1, 32).sum(-1) * step).sum(-1)          # [N]
    fp32 = 1e-6 * (wq.double().abs() @ x.double().abs()) + 1e-6
    return codes + fp32


@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("shape", Q4_SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_the_q4_row_linear_is_the_dequantized_blocks_times_x(shape, threads):
    """Against the blocks dequantized (quantize.dequantize_q4_1) times x in fp64, within the bound of x's 16-bit
    fixed point (_x16_bound): odd and even row counts (its rows go in pairs, split over threads where a share may be
    empty), one group and many; the portable loop too."""
    from modeld_cell.quantize import dequantize_q4_1, q4_1_blocks, quantize_q4_1

    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(k, generator=g)
    qs, d, m = q4_1_blocks(w)
    assert qs.shape == (n, k // 2) and qs.dtype == torch.uint8 and d.shape == m.shape == (n, k // 32)
    want = dequantize_q4_1(*quantize_q4_1(w)).double() @ x.double()
    bound = _x16_bound(dequantize_q4_1(*quantize_q4_1(w)) - m.repeat_interleave(32, 1), x)
    for portable in (False, True):
        got = cpu.gemv_q4(qs, d, m, x, portable=portable, threads=threads)
        assert got.shape == (n,) and got.dtype == torch.float32
        err = (got.double() - want).abs()
        assert bool((err <= bound).all()), f"gemv_q4 portable={portable}: error {err.max():.3e} over its bound"


def test_the_q4_blocks_hold_a_group_as_gguf_does():
    """Weight j of a 32-weight group in the low nibble of byte j, weight j + 16 in its high nibble; w = d * q + m."""
    from modeld_cell.quantize import q4_1_blocks

    q = torch.arange(32).remainder(16).float()            # codes 0..15, 0..15
    w = (0.5 * q - 1.0).view(1, 32)                        # d 0.5, m -1
    qs, d, m = q4_1_blocks(w)
    assert torch.equal(d, torch.tensor([[0.5]])) and torch.equal(m, torch.tensor([[-1.0]]))
    assert qs[0].tolist() == [j | (j << 4) for j in range(16)]


def test_the_q4_row_linear_refuses_what_it_cannot_multiply():
    from modeld_cell.quantize import q4_1_blocks

    qs, d, m = q4_1_blocks(torch.randn(4, 64))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        cpu.gemv_q4(qs, d, m, torch.randn(63))
    with pytest.raises(ValueError, match="fp32"):
        cpu.gemv_q4(qs, d, m, torch.randn(64).bfloat16())
    with pytest.raises(ValueError, match="uint8"):
        cpu.gemv_q4(qs.int(), d, m, torch.randn(64))


@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("shape", Q4_SHAPES, ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_the_q8_head_is_its_blocks_times_x(shape, threads):
    """The layer step's Q8_0 head (cpu.c's gemv_q8) against d * q times x in fp64, within the bound of x's 16-bit
    fixed point; the portable loop too. The blocks of Q8_0 values (the group's largest magnitude at code 127) are
    those values again, exactly."""
    from modeld_cell.quantize import q8_0_blocks

    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k + 7)
    qs, d = q8_0_blocks(torch.randn(n, k, generator=g))
    w = (qs.view(n, -1, 32).float() * d[..., None]).view(n, k)
    q2, d2 = q8_0_blocks(w)
    assert torch.equal(q2, qs) and torch.equal(d2, d)
    x = torch.randn(k, generator=g)
    want = w.double() @ x.double()
    bound = _x16_bound(w, x)
    for portable in (False, True):
        got = cpu.gemv_q8(qs, d, x, portable=portable, threads=threads)
        assert got.shape == (n,) and got.dtype == torch.float32
        err = (got.double() - want).abs()
        assert bool((err <= bound).all()), f"gemv_q8 portable={portable}: error {err.max():.3e} over its bound"
