"""Merging partial attention states: reference vs fp64 full attention, triton vs reference, empty parts."""

import pytest
import torch

from modeld_cell.kernels.merge import reference as ref

from .utils import DTYPE_NAME, TOL, assert_close, naive_attention

pytestmark = pytest.mark.kernels


def _parts_from_attention(lead: int, H: int, D: int, part_lens: list[int]):
    """Real partial states: split L keys into parts, attend each part in fp64.

    Returns outs [S, lead, H, D] (NaN for empty parts, which must not leak), lses [S, lead, H], and the
    full-attention (out, lse) over all keys.
    """
    L = sum(part_lens)
    q = torch.randn(lead, H, D)
    k = torch.randn(lead, H, L, D)
    v = torch.randn(lead, H, L, D)
    S = len(part_lens)
    outs = torch.full((S, lead, H, D), float("nan"), dtype=torch.float64)
    lses = torch.full((S, lead, H), float("-inf"), dtype=torch.float64)
    full_out = torch.zeros(lead, H, D, dtype=torch.float64)
    full_lse = torch.full((lead, H), float("-inf"), dtype=torch.float64)
    scale = D**-0.5
    for i in range(lead):
        for h in range(H):
            start = 0
            for s, n in enumerate(part_lens):
                if n:
                    outs[s, i, h], lses[s, i, h] = naive_attention(
                        q[i, h], k[i, h, start : start + n], v[i, h, start : start + n], scale
                    )
                start += n
            full_out[i, h], full_lse[i, h] = naive_attention(q[i, h], k[i, h], v[i, h], scale)
    return outs, lses, full_out, full_lse


PART_LENS = [[5], [3, 4], [0, 6], [7, 0, 0, 2], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0]]


@pytest.mark.parametrize("part_lens", PART_LENS, ids=lambda p: "parts" + "_".join(map(str, p)))
def test_reference_merge_equals_full_attention(part_lens):
    outs, lses, full_out, full_lse = _parts_from_attention(2, 3, 16, part_lens)
    out, lse = ref.merge_states_n(outs.float(), lses.float())
    assert_close("out", full_out, out, 1e-5, 1e-5)
    assert_close("lse", full_lse, lse, 1e-5, 1e-5)


def test_reference_two_way_matches_n_way():
    outs, lses, full_out, full_lse = _parts_from_attention(2, 3, 16, [4, 9])
    out, lse = ref.merge_states(outs[0].float(), lses[0].float(), outs[1].float(), lses[1].float())
    assert_close("out", full_out, out, 1e-5, 1e-5)
    assert_close("lse", full_lse, lse, 1e-5, 1e-5)


def test_all_empty_gives_zero_and_minus_inf():
    outs = torch.full((3, 2, 4, 8), float("nan"))
    lses = torch.full((3, 2, 4), float("-inf"))
    out, lse = ref.merge_states_n(outs, lses)
    assert torch.equal(out, torch.zeros(2, 4, 8))
    assert torch.isneginf(lse).all()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="lses shape"):
        ref.merge_states_n(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="equal shapes"):
        ref.merge_states(torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.zeros(3, 4, 16), torch.zeros(3, 4))


def _random_states(S, B, H, D, dtype, empty_frac=0.3):
    """Random states with some empty parts (lse -inf, out NaN) and some rows where every part is empty."""
    outs = torch.randn(S, B, H, D)
    lses = torch.randn(S, B, H) * 4
    empty = torch.rand(S, B, H) < empty_frac
    empty[:, 0, 0] = True  # one row with every part empty
    lses[empty] = float("-inf")
    outs[empty] = float("nan")
    return outs.to(dtype), lses


MERGE_SHAPES = [(1, 2, 3, 16), (2, 3, 9, 64), (5, 2, 4, 24), (8, 1, 3, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("S,B,H,D", MERGE_SHAPES, ids=[f"S{s}-B{b}-H{h}-D{d}" for s, b, h, d in MERGE_SHAPES])
def test_triton_merge_n_vs_reference(S, B, H, D, dtype, device):
    from modeld_cell.kernels.merge import triton as tri

    outs, lses = _random_states(S, B, H, D, dtype)
    ref_out, ref_lse = ref.merge_states_n(outs, lses)
    out, lse = tri.merge_states_n(outs.to(device), lses.to(device))
    atol, rtol = TOL[dtype]
    assert_close(f"S{S}-B{B}-H{H}-D{D} out", ref_out.float(), out.float(), atol, rtol)
    assert_close(f"S{S}-B{B}-H{H}-D{D} lse", ref_lse, lse, 1e-5, 1e-5)
    assert torch.isneginf(lse[0, 0]) and not out.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("case", ["both", "a_empty", "b_empty", "mixed"])
def test_triton_merge_two_vs_reference(case, dtype, device):
    from modeld_cell.kernels.merge import triton as tri

    outs, lses = _random_states(2, 3, 9, 32, dtype, empty_frac=0.0 if case != "mixed" else 0.4)
    if case == "a_empty":
        lses[0], outs[0] = float("-inf"), float("nan")
    if case == "b_empty":
        lses[1], outs[1] = float("-inf"), float("nan")
    ref_out, ref_lse = ref.merge_states(outs[0], lses[0], outs[1], lses[1])
    out, lse = tri.merge_states(*(t.to(device) for t in (outs[0], lses[0], outs[1], lses[1])))
    atol, rtol = TOL[dtype]
    assert_close(f"{case} out", ref_out.float(), out.float(), atol, rtol)
    assert_close(f"{case} lse", ref_lse, lse, 1e-5, 1e-5)


def test_the_split_count_is_no_compile_key():
    """The merge runs for a split count that grows with the context: S must be a plain runtime argument (not a
    constexpr block size, not specialized), so one compiled kernel serves every count."""
    import inspect

    from modeld_cell.kernels.merge import triton as mtri

    k = mtri._merge_states_kernel          # a JITFunction on CUDA, an InterpretedFunction under the interpreter
    fn = getattr(k, "fn", k)
    params = inspect.signature(fn).parameters
    constexprs = [n for n, p in params.items() if "constexpr" in str(p.annotation)]
    assert constexprs == ["D", "BLOCK_D"], constexprs
    opts = getattr(k, "kwargs", None) or {"do_not_specialize": [p.name for p in getattr(k, "params", [])
                                                                if getattr(p, "do_not_specialize", False)]}
    assert "S" in (opts.get("do_not_specialize") or []), "S is specialized (S % 16, S == 1): recompiles by count"
