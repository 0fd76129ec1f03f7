"""Shared helpers for the kernel tests: one assert_close and the fp64 naive computations that prove the references."""

from __future__ import annotations

import math

import torch

# (atol, rtol) of a kernel's output against its fp32 reference, by input dtype.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPE_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float, rtol: float) -> None:
    """Assert |out - ref| <= atol + rtol |ref| elementwise; report max-abs and relative-RMS error on failure.

    Infinite reference entries (e.g. lse = -inf of an empty sequence) must be matched exactly; NaN never passes.
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    r, o = ref.detach().double().cpu(), out.detach().double().cpu()
    assert not torch.isnan(o).any(), f"{name}: output has {int(torch.isnan(o).sum())} NaN"
    assert not torch.isnan(r).any(), f"{name}: reference has NaN"
    inf = torch.isinf(r)
    assert torch.equal(o[inf], r[inf]), f"{name}: infinite reference entries not matched exactly"
    assert not torch.isinf(o[~inf]).any(), f"{name}: output infinite where the reference is finite"
    r, o = r[~inf], o[~inf]
    if r.numel() == 0:
        return
    err = (o - r).abs()
    max_abs = float(err.max())
    rel_rms = math.sqrt(float((err**2).mean())) / max(math.sqrt(float((r**2).mean())), 1e-30)
    bad = err > atol + rtol * r.abs()
    assert not bad.any(), (
        f"{name}: {int(bad.sum())}/{r.numel()} elements off; max_abs={max_abs:.3e} rel_rms={rel_rms:.3e} "
        f"(atol={atol:g}, rtol={rtol:g})"
    )


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """sqrt(mean((out - ref)^2)) / sqrt(mean(ref^2)) in fp64."""
    r, o = ref.double(), out.double()
    return float(((o - r) ** 2).mean().sqrt() / (r**2).mean().sqrt().clamp_min(1e-30))


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query head over L keys in fp64: q [D], k/v [L, D] -> (out [D], lse scalar natural log). L = 0 -> 0, -inf."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.tensor(float("-inf"), dtype=torch.float64)
    s = k @ q * scale
    lse = torch.logsumexp(s, 0)
    return torch.softmax(s, 0) @ v, lse


def naive_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Token-by-token gather through the block table, then per-head fp64 softmax. Returns (out, lse) fp64."""
    B, Hq, D = q.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        pos = torch.arange(int(seq_lens[b]))
        phys = block_tables[b, pos // BS].long()
        k = k_cache[phys, pos % BS].double()  # [L, Hkv, D]
        v = v_cache[phys, pos % BS].double()
        for h in range(Hq):
            out[b, h], lse[b, h] = naive_attention(q[b, h], k[:, h // G], v[:, h // G], scale)
    return out, lse


def naive_block_sparse(q, k, v, block_mask, block_size, scale):
    """fp64 causal attention with an explicit [H, T, T] token mask expanded from the block mask. Returns out [T, H, D]."""
    T, H, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    blk = torch.arange(T) // block_size
    causal = torch.arange(T)[:, None] >= torch.arange(T)[None, :]
    for h in range(H):
        keep = block_mask[h][blk[:, None], blk[None, :]] & causal  # [T, T]
        for t in range(T):
            kk = keep[t].nonzero().flatten()
            out[t, h] = naive_attention(q[t, h], k[kk, h // G], v[kk, h // G], scale)[0]
    return out


def make_paged(lens, Hkv, D, BS, dtype=torch.float32, spare_blocks=3, width_extra=1, device="cpu"):
    """A shuffled paged cache holding len(lens) sequences.

    Returns (k_cache [NB, BS, Hkv, D], v_cache, block_tables [B, MB] int32 with -1 past each sequence's used
    blocks, seq_lens [B] int32).
    """
    need = [(n + BS - 1) // BS for n in lens]
    NB = sum(need) + spare_blocks
    MB = max(need + [1]) + width_extra
    perm = torch.randperm(NB)
    bt = torch.full((len(lens), MB), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i : i + n].int()
        i += n
    k_cache = torch.randn(NB, BS, Hkv, D).to(dtype)
    v_cache = torch.randn(NB, BS, Hkv, D).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return k_cache.to(device), v_cache.to(device), bt.to(device), seq_lens.to(device)


def skip_if_interpreter_cannot(dtype: torch.dtype, device: torch.device) -> None:
    """Skip bf16 tl.dot cases on the CPU interpreter: it multiplies bf16 bit patterns (triton-lang/triton#11584;
    the maintainers say bf16 is not supported there). They run on CUDA; fp16 covers half precision on CPU."""
    import pytest

    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("triton interpreter has no bf16 tl.dot (triton-lang/triton#11584); runs on CUDA")
