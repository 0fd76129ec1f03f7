"""Paged prefill: reference vs an fp64 dense causal computation, triton vs reference (interpreter on CPU), bad input."""

import pytest
import torch

from modeld_cell.kernels import dispatch
from modeld_cell.kernels.paged_prefill import reference as ref
from modeld_cell.kernels.quant_kv import reference as quant_ref

from .utils import TOL, assert_close

pytestmark = pytest.mark.kernels

# (past, T, Hq, Hkv, D, BLOCK_SIZE); SmolLM2 is Hq 9 / Hkv 3 / D 64, pages of 16.
CASES = [
    (0, 1, 4, 4, 16, 16),
    (0, 17, 9, 3, 64, 16),        # one row past a page
    (15, 2, 9, 3, 64, 16),        # the chunk straddles a page boundary after a cached past
    (33, 63, 9, 3, 32, 16),       # odd sizes, several query blocks
    (64, 111, 8, 1, 16, 32),      # G = 8, a tile spans pages
    (5, 40, 6, 2, 16, 1),         # one token per page
    (100, 1, 9, 3, 64, 16),       # a one-row chunk (a decode-shaped prefill)
]


def case_id(c):
    past, T, Hq, Hkv, D, BS = c
    return f"P{past}-T{T}-Hq{Hq}-Hkv{Hkv}-D{D}-BS{BS}"


def make(past, T, Hq, Hkv, D, BS, dtype=torch.float32, device="cpu"):
    """A shuffled block table over a cache with spare blocks, and queries."""
    n = past + T
    nblk = -(-n // BS)
    perm = torch.randperm(nblk + 3)[:nblk]
    kc = torch.randn(nblk + 3, BS, Hkv, D)
    vc = torch.randn(nblk + 3, BS, Hkv, D)
    q = torch.randn(T, Hq, D)
    return (q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype),
            perm.to(torch.int32).to(device))


def naive(q, kc, vc, bt, past, scale):
    """fp64, token by token through the block table."""
    T, Hq, D = q.shape
    BS, Hkv = kc.shape[1], kc.shape[2]
    G = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for i in range(T):
        n = past + i + 1
        idx = [int(bt[j // BS]) * BS + j % BS for j in range(n)]
        k = kc.reshape(-1, Hkv, D)[idx].double()
        v = vc.reshape(-1, Hkv, D)[idx].double()
        for h in range(Hq):
            w = torch.softmax(k[:, h // G] @ q[i, h].double() * scale, 0)
            out[i, h] = w @ v[:, h // G]
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_vs_naive(case):
    past, T, Hq, Hkv, D, BS = case
    q, kc, vc, bt = make(*case)
    want = naive(q, kc, vc, bt, past, 0.3)
    assert_close(case_id(case), want, ref.paged_prefill(q, kc, vc, bt, past, sm_scale=0.3), 1e-5, 1e-5)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_vs_reference(case, device):
    past, T, Hq, Hkv, D, BS = case
    q, kc, vc, bt = make(*case, device=device)
    want = ref.paged_prefill(q, kc, vc, bt, past)
    got = dispatch.paged_prefill(q, kc, vc, bt, past, force="triton")
    assert_close(case_id(case), want, got, *TOL[torch.float32])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=case_id)
def test_triton_quantized_cache_vs_reference(case, fmt, device):
    """int8 / fp8 caches with per-token-per-head scales are dequantized in the kernel's registers."""
    past, T, Hq, Hkv, D, BS = case
    q, kc, vc, bt = make(*case)
    (kq, ks), (vq, vs) = quant_ref.quantize(kc, fmt), quant_ref.quantize(vc, fmt)
    want = ref.paged_prefill(q, kq, vq, bt, past, k_scale=ks, v_scale=vs)
    # the reference reads what the cache stores: the same as attending the dequantized values
    deq = ref.paged_prefill(q, quant_ref.dequantize(kq, ks), quant_ref.dequantize(vq, vs), bt, past)
    assert_close(f"{case_id(case)}-{fmt} reference", deq, want, 1e-5, 1e-5)
    got = dispatch.paged_prefill(q.to(device), kq.to(device), vq.to(device), bt.to(device), past,
                                 k_scale=ks.to(device), v_scale=vs.to(device), force="triton")
    assert_close(f"{case_id(case)}-{fmt}", want, got, *TOL[torch.float32])


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, bt: (q[0], k, v, bt, 0), "q must be"),
    (lambda q, k, v, bt: (q, k, v, bt.long(), 0), "int32"),
    (lambda q, k, v, bt: (q, k, v, bt[:1], 16), "does not cover"),
    (lambda q, k, v, bt: (q, k.half(), v.half(), bt, 0), "must have q's dtype"),
], ids=["q-rank", "table-dtype", "table-short", "dtype"])
def test_bad_input_is_refused(bad, match):
    q, kc, vc, bt = make(3, 20, 9, 3, 16, 16)
    with pytest.raises(ValueError, match=match):
        ref.paged_prefill(*bad(q, kc, vc, bt))
