"""A small, flat Llama-family decoder over a paged KV cache (gpt-fast style).

Covers Llama (1/2/3, incl. llama3 RoPE scaling), Qwen2 (q/k/v bias) and Mistral: RMSNorm, RoPE (theta, optional
linear / llama3 frequency scaling), grouped-query attention, SwiGLU, tied or untied embeddings. Weights use the HF
layout (``rotate_half`` RoPE); the GGUF loader undoes llama.cpp's Q/K row permutation before they get here.

The forward pass takes a flat token batch ``tokens [N]`` with ``positions [N]`` and an ``AttnMetadata`` that says
which session each token belongs to. Two shapes occur:
  prefill: one session, N = T new tokens at positions past..past+T-1
  decode:  B sessions, N = B, one new token each
Every layer writes its new K/V into the paged cache and then calls ``paged_attention`` -- the ONE place where
attention reaches the kernels (``modeld_cell.kernels.dispatch`` when it is present and validated, else plain torch).
On CPU, dense attention (prefill chunks and decode steps alike) is ``_segmented_attention``, and every linear layer
runs with at least two rows (``RowLinear``): each row's result is then bitwise independent of how the sequence was
chunked, which makes prefix reuse exact in bf16 too (docs/reuse.md). On CUDA a quantized cache decodes through
``dispatch.quant_paged_decode``. A block-sparse cell's long prefill chunks (fresh or after cached tokens) go through
``dispatch.sparse_prefill``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels import dispatch
from .kernels.paged_decode.cpu import rows_attention
from .kernels.quant_kv.reference import dequantize, format_of, is_rotated, rotate, unrotate


@dataclass
class ModelArgs:
    arch: str = "llama"                  # llama | qwen2 | mistral (decides loader details only)
    vocab_size: int = 32000
    dim: int = 4096                      # hidden size
    n_layers: int = 32
    n_heads: int = 32                    # query heads
    n_kv_heads: int = 32                 # key/value heads (GQA: n_heads % n_kv_heads == 0)
    head_dim: int = 128
    intermediate_size: int = 11008       # SwiGLU inner size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # {"type": "linear", "factor"} | {"type": "llama3", "factor", ...}
    max_seq_len: int = 4096              # context length served (the trained one unless spec.model.ropeScaling)
    trained_max_seq_len: int | None = None  # the trained one, when a spec's RoPE scaling extends max_seq_len
    tie_embeddings: bool = False
    qkv_bias: bool = False               # Qwen2
    sliding_window: int | None = None    # Mistral v0.1; the engine refuses tiers beyond it (no SWA here)

    def __post_init__(self) -> None:
        assert self.n_heads % self.n_kv_heads == 0, f"n_heads {self.n_heads} % n_kv_heads {self.n_kv_heads} != 0"

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        if name not in transformer_configs:
            raise KeyError(f"unknown model config {name!r}; known: {sorted(transformer_configs)}")
        return replace(transformer_configs[name])

    @property
    def n_params(self) -> int:
        attn = self.dim * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * self.dim * self.intermediate_size
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.dim) + emb + self.dim


transformer_configs: dict[str, ModelArgs] = {
    "smollm2-135m": ModelArgs(
        arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
        intermediate_size=1536, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
    ),
    "smollm2-360m": ModelArgs(
        arch="llama", vocab_size=49152, dim=960, n_layers=32, n_heads=15, n_kv_heads=5, head_dim=64,
        intermediate_size=2560, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
    ),
    "llama-3.2-1b": ModelArgs(
        arch="llama", vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
        intermediate_size=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
        rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen2.5-0.5b": ModelArgs(
        arch="qwen2", vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
        intermediate_size=4864, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=True,
        qkv_bias=True,
    ),
    "mistral-7b-v0.3": ModelArgs(
        arch="mistral", vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=14336, rope_theta=1000000.0, max_seq_len=32768,
    ),
}


# ----------------------------------------------------------------------------------------------------------------
# Attention metadata and the kernel seam


@dataclass
class AttnMetadata:
    """Where the N new tokens of a forward pass live in the paged cache.

    kind:          "prefill" (B == 1, N == T new tokens) or "decode" (N == B, one token per session)
    slot_mapping:  [N] int64, flat cache slot (block * block_size + offset) each new token's K/V is written to
    block_tables:  [B, max_blocks] int32, the session's blocks in order (padding: 0, never read)
    seq_lens:      [B] int32, tokens in the cache per session AFTER this step (past + new)
    seq_lens_list: the same as python ints (host-side loops avoid a sync per read)
    contiguous:    per session, the first block id when its blocks are consecutive ids (zero-copy views), else None
    sparse:        prefill only: block-sparse settings ({"block_size", "keep_ratio", "max_keep_tokens", "min_tokens",
                   "max_density"}) when the cell asked for block-sparse and this chunk qualifies
                   (sparse_policy.SparsePolicy.meta); None = dense
    sparse_log:    filled by paged_attention, one {"path", "density", "backend"} per layer that tried sparse
    """

    kind: str
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    seq_lens_list: list[int]
    block_size: int
    contiguous: list[int | None] = field(default_factory=list)
    sparse: dict | None = None
    sparse_log: list[dict] = field(default_factory=list)
    # The engine's kernel choice for decode, carried per forward (model.py holds no mutable module state):
    # fn(q, k_cache, v_cache, block_tables, seq_lens, scale) -> out [B, Hq, D], i.e. a validated
    # ``kernels.dispatch.paged_decode``; None = the zero-copy torch path (on CPU it reads each session's contiguous
    # block run as a strided view, ~3x faster than gathering blocks).
    decode_kernel: Callable[..., Tensor] | None = None
    # a quantized cache decodes through ``dispatch.quant_paged_decode`` on CPU too (MODELD_DECODE_ATTENTION=dispatch);
    # by default the CPU dequantizes into _segmented_attention like a prefill. Always the fused kernel off the CPU.
    quant_decode_dispatch: bool = False
    # A backend's whole attention, carried per forward: fn(q, k_new, v_new, k_cache, v_cache, meta, scales) -> [N, Hq,
    # D] (the triton runner's kernels, triton_runner.py); None = the torch paths below.
    attend: Callable[..., Tensor] | None = None
    # CPU prefill chunks, and the exact decode rows, attend through cpu.c's row attention (kernels/paged_decode/cpu.py
    # rows_attention) instead of _segmented_attention: runner.TorchRunner sets it where the model's row_attention
    # serves its pool (an unquantized bf16/fp32 cache)
    rows_attention: bool = False


# Present since torch 2.3: flash attention on CPU that also returns the natural-log LSE, needed to merge the
# unmasked past part and the causal new-token part of a prefill chunk exactly.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunking_invariant(device: torch.device) -> bool:
    """Whether attention and matmuls on ``device`` give each row the same bits however a sequence is chunked
    (``_segmented_attention`` + ``RowLinear``): the CPU torch path. CUDA runs SDPA / Triton, which do not promise it."""
    return device.type == "cpu" and _FLASH_CPU is not None


# Row counts the exactness probe compares with a 512-row call: decode batches, the 1-3 row flash tail, small-M kernel
# choices (AMX's bf16 GEMM takes another kernel below ~48 rows), chunk remainders.
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 48, 64, 97, 128, 255, 300, 511)


@torch.no_grad()
def probe_chunking_invariance(model: Transformer, rows: int = 512) -> str | None:
    """Measure, on this process's kernels, what bitwise reuse rests on: every row of a matmul (each of layer 0's four
    RowLinears, at the model's dtype) and of the attention (``_segmented_attention``, or cpu.c's row attention where
    the model took it) gets the same bits whatever the other rows of its call, and at one thread as at the process's
    count (a decode step may run at one thread). None when it holds, else what differed. It is a measurement because
    it depends on the BLAS / oneDNN kernel the CPU gets: with AMX, bf16 GEMMs of
    16-32 rows round differently from 512-row ones (issue #11). Attention runs first, so a CPU whose kernels cannot
    compute the dtype at all raises here, at start, not at a first request."""
    w = model.norm.weight                                  # the compute dtype and device (also of quantized weights)
    if not chunking_invariant(w.device):
        return f"{w.device.type}: not the CPU segmented path"
    g = torch.Generator().manual_seed(0)
    a = model.args
    q = torch.randn(rows, a.n_heads, a.head_dim, generator=g).to(w.dtype)
    k = torch.randn(rows, a.n_kv_heads, a.head_dim, generator=g).to(w.dtype)
    v = torch.randn(rows, a.n_kv_heads, a.head_dim, generator=g).to(w.dtype)
    scale = 1.0 / math.sqrt(a.head_dim)
    rows_name = getattr(model, "row_attention", None)
    if rows_name:        # cpu.c's row attention serves (runner.choose_row_attention): a paged cache of these keys
        kc, vc = k.view(-1, 16, *k.shape[1:]), v.view(-1, 16, *v.shape[1:])
        table = torch.arange(kc.shape[0], dtype=torch.int32)

        def attend(q0: int, t: int) -> Tensor:
            return rows_attention(q[q0 : q0 + t], kc, vc, table, q0, scale)
    else:
        def attend(q0: int, t: int) -> Tensor:
            return _segmented_attention(q[q0 : q0 + t], k[: q0 + t], v[: q0 + t], q0, scale)
    full = attend(0, rows)
    for q0, t in ((0, 1), (0, 97), (97, 1), (97, 203), (300, 211), (510, 2), (rows - 1, 1)):
        got = attend(q0, t)
        if not torch.equal(got, full[q0 : q0 + t]):
            return (f"attention ({rows_name or 'segmented'}, {w.dtype}): {t} rows at position {q0} differ from the "
                    f"same rows of a one-pass {rows}-row call on this CPU")
    if (n := torch.get_num_threads()) > 1 and not torch.equal(at_one_thread(lambda: attend(97, 203)), full[97:300]):
        return (f"attention ({rows_name or 'segmented'}, {w.dtype}): rows computed at one thread differ from the same "
                f"rows at {n} threads on this CPU")
    return linears_row_invariant(layer_linears(model.layers[0]), w.dtype, g, rows)


def layer_linears(layer: Any) -> tuple[tuple[str, Any], ...]:
    """A transformer layer's four linears by name, as the exactness probes multiply them."""
    return (("attention.wqkv", layer.attention.wqkv), ("attention.wo", layer.attention.wo),
            ("feed_forward.w13", layer.feed_forward.w13), ("feed_forward.w2", layer.feed_forward.w2))


def at_one_thread(fn: Any) -> Any:
    """fn() with torch at one intra-op thread (a one-session decode step often runs so: runner.choose_decode_threads),
    the process's count restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(n)


@torch.no_grad()
def linears_row_invariant(named: Any, dtype: torch.dtype, g: torch.Generator, rows: int = 512) -> str | None:
    """Every row of each (name, linear)'s matmul gets the same bits in a call of PROBE_ROWS rows as in a ``rows``-row
    one (inputs in ``dtype`` from ``g``), and at one thread as at the process's count (a decode step at one thread
    writes K/V a prefill at every thread must reproduce); None when it holds, else what differed."""
    threads = torch.get_num_threads()
    for name, lin in named:
        x = torch.randn(rows, lin.in_features, generator=g).to(dtype)
        full = lin(x)
        for m in PROBE_ROWS:
            if not torch.equal(lin(x[:m]), full[:m]):
                return (f"{name} ({dtype}): the rows of a {m}-row matmul differ from the same rows of a {rows}-row "
                        "one on this CPU")
        if threads > 1:
            for m in (1, 33, rows):
                if not torch.equal(at_one_thread(lambda: lin(x[:m])), full[:m]):  # noqa: B023
                    return (f"{name} ({dtype}): the rows of a {m}-row matmul at one thread differ from the same rows "
                            f"at {threads} threads on this CPU")
    return None


def _past_kv(cache: Tensor, meta: AttnMetadata, b: int, n: int) -> Tensor:
    """The first n cached tokens of session b. cache: [num_blocks, BS, Hkv, D] -> [n, Hkv, D] (a view if possible)."""
    bs = meta.block_size
    start = meta.contiguous[b] if meta.contiguous else None
    if start is not None:
        return cache.view(-1, *cache.shape[2:])[start * bs : start * bs + n]
    nblk = (n + bs - 1) // bs
    return cache.index_select(0, meta.block_tables[b, :nblk].long()).view(-1, *cache.shape[2:])[:n]


def _past_float(cache: Tensor, scales: Tensor | None, meta: AttnMetadata, n: int, dtype: torch.dtype,
                b: int = 0) -> Tensor:
    """Session b's first n cached tokens in ``dtype``: [n, Hkv, D]. A quantized cache dequantizes only these blocks
    (a transient copy; the cache itself stays quantized)."""
    if scales is None:
        return _past_kv(cache, meta, b, n).to(dtype)
    return dequantize(_past_kv(cache, meta, b, n), _past_kv(scales, meta, b, n)).to(dtype)


# Keys per segment of the CPU attention (see _segmented_attention).
ATTN_SEGMENT = 512


def _segmented_attention(q: Tensor, k: Tensor, v: Tensor, q0: int, scale: float,
                         seg: int = ATTN_SEGMENT, row_path: bool = True) -> Tensor:
    """Causal attention of T query rows at positions q0..q0+T-1 over keys 0..q0+T-1, computed so that every row's
    result is bitwise the same whatever the other rows are: a prompt prefilled in one chunk, in chunks cut anywhere
    (after a reused prefix), or token by token (decode) yields the same bits. That is what makes prefix reuse exact
    in bf16, where a different split of the same sum already rounds differently (docs/reuse.md, "Exactness").

    The keys are cut at absolute multiples of ``seg``. Row p attends segment [a, a+seg) unmasked when p >= a+seg,
    masked (key <= p; the open segment zero-padded to ``seg`` keys) when p lies inside it: which kind of flash call
    computes (row, segment) depends only on p, and every call has exactly ``seg`` keys. Segments below the chunk's
    first row go into one batched call. The per-segment (output, LSE) pairs then merge by one fixed formula: the
    maximum LSE, then weights and weighted outputs summed in segment order (segments a row cannot see weigh an exact
    0). Flash rows are independent of how many rows share a call once each call has a multiple of 4 rows (a q-block
    of 1-3 rows takes another GEMM path; tail copies pad it). tests/cell/test_invariance.py checks all of this end
    to end on the real model: a platform where it fails shows up there, not as silent drift.

    q: [T, Hq, D]; k, v: [n, Hkv, D] with n == q0 + T (keys of the new rows included); returns [T, Hq, D]. One row
    (a decode step) takes ``_segmented_row``, the same computation in fewer ops (``row_path=False``: this one, which
    its test compares it with).
    """
    assert _FLASH_CPU is not None
    t, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    assert n == q0 + t, (n, q0, t)
    if t == 1 and row_path:
        return _segmented_row(q, k, v, q0, scale, seg)
    dev = q.device
    nseg = -(-n // seg)
    qh = q.view(t, hkv, g, d).permute(1, 2, 0, 3)                  # q: [Hkv, G, T, D] (rows of a KV head stacked)
    lse_all = torch.full((nseg, hkv, g, t), -math.inf, dtype=torch.float32, device=dev)
    parts: list[tuple[int, int, int, Tensor]] = []                  # (segment, first row, end row, output [Hkv,G,R,D])

    def rows_of(r0: int, r1: int) -> tuple[Tensor, int]:
        qq = qh[:, :, r0:r1].reshape(1, hkv, g * (r1 - r0), d)
        extra = -(g * (r1 - r0)) % 4
        if extra:
            qq = torch.cat([qq, qq[:, :, -1:].expand(1, hkv, extra, d)], 2)
        return qq, extra

    def store(s0: int, r0: int, r1: int, o: Tensor, lse: Tensor) -> None:
        rows = r1 - r0
        for i in range(o.shape[0]):
            parts.append((s0 + i, r0, r1, o[i, :, : g * rows].view(hkv, g, rows, d)))
        lse_all[s0 : s0 + o.shape[0], :, :, r0:r1] = lse[:, :, : g * rows].reshape(-1, hkv, g, rows)

    nb = q0 // seg                                                   # segments every row sees whole
    if nb:
        qq, _ = rows_of(0, t)
        kb = k[: nb * seg].reshape(nb, seg, hkv, d).permute(0, 2, 1, 3)   # [nb, Hkv, seg, D] (strided view)
        vb = v[: nb * seg].reshape(nb, seg, hkv, d).permute(0, 2, 1, 3)
        o, lse = _FLASH_CPU(qq.expand(nb, -1, -1, -1), kb, vb, scale=scale)[:2]
        store(0, 0, t, o, lse)
    for si in range(nb, nseg):
        a, b = si * seg, (si + 1) * seg
        ks, vs = k[a:b].permute(1, 0, 2), v[a:b].permute(1, 0, 2)       # [Hkv, L, D]
        if ks.shape[1] < seg:                                        # the open segment: pad to seg keys (masked)
            pad = ks.new_zeros(hkv, seg - ks.shape[1], d)
            ks, vs = torch.cat([ks, pad], 1), torch.cat([vs, pad], 1)
        ks, vs = ks.unsqueeze(0), vs.unsqueeze(0)
        for r0, r1, masked in ((max(0, b - q0), t, False), (max(0, a - q0), min(t, b - q0), True)):
            if r1 <= r0:
                continue
            qq, extra = rows_of(r0, r1)
            mask = None
            if masked:
                off = q0 + r0 - a                                    # row r0's offset in the segment
                mask = _causal_rows(seg, q.dtype, dev)[off : off + r1 - r0].repeat(g, 1)      # [G * R, seg]
                if extra:
                    mask = torch.cat([mask, mask[-1:].expand(extra, seg)])
                mask = mask[None, None]
            o, lse = _FLASH_CPU(qq, ks, vs, attn_mask=mask, scale=scale)[:2]
            store(si, r0, r1, o, lse)
    # merge: m = max LSE (segment 0 is always seen, so finite); weights and weighted outputs summed in segment order.
    # A (row, segment) pair a row cannot see is skipped, which is the same as adding its exact 0.
    w = torch.exp(lse_all - lse_all.amax(0))                         # [nseg, Hkv, G, T]
    num = torch.zeros(hkv, g, t, d, dtype=torch.float32, device=dev)
    den = torch.zeros(hkv, g, t, dtype=torch.float32, device=dev)
    for si, r0, r1, o in parts:                                      # segment order; one segment's row ranges disjoint
        num[:, :, r0:r1].addcmul_(o, w[si, :, :, r0:r1].unsqueeze(-1))
        den[:, :, r0:r1].add_(w[si, :, :, r0:r1])
    return num.div_(den.unsqueeze(-1)).to(q.dtype).permute(2, 0, 1, 3).reshape(t, hq, d)


_CAUSAL: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
_ZEROS: dict[tuple[int, int, int, torch.dtype, torch.device], Tensor] = {}


def _causal_rows(seg: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[seg, seg] additive mask, row i: 0 for keys 0..i, -inf after (row i of a segment's causal mask; built once per
    dtype and device, read by slicing: a decode step built it from aranges in six ops per layer)."""
    key = (seg, dtype, device)
    if (m := _CAUSAL.get(key)) is None:
        vis = torch.ones(seg, seg, dtype=torch.bool, device=device).tril()
        m = _CAUSAL[key] = torch.zeros(seg, seg, dtype=dtype, device=device).masked_fill_(~vis, -math.inf)
    return m


def _zeros(hkv: int, seg: int, d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A shared, never written [Hkv, seg, D] zero block: the open segment's padding is sliced from it."""
    key = (hkv, seg, d, dtype, device)
    if (z := _ZEROS.get(key)) is None:
        z = _ZEROS[key] = torch.zeros(hkv, seg, d, dtype=dtype, device=device)
    return z


def _segmented_row(q: Tensor, k: Tensor, v: Tensor, q0: int, scale: float, seg: int) -> Tensor:
    """_segmented_attention of one row (a decode step), the same flash calls on the same inputs and the same merge
    formula in the same order, so the same bits, in about half the ops (no per-part bookkeeping, the mask a slice of
    the cached causal table, the padding a slice of a cached zero block). q: [1, Hq, D]; k, v: [q0 + 1, Hkv, D]."""
    hkv, d = k.shape[1], k.shape[2]
    return segmented_row(q, k, v, q0, scale, seg, _causal_rows(seg, q.dtype, q.device),
                         _zeros(hkv, seg, d, q.dtype, q.device))


def segmented_row(q: Tensor, k: Tensor, v: Tensor, q0: int, scale: float, seg: int, causal: Tensor,
                  zeros: Tensor) -> Tensor:
    """``_segmented_row`` with its tables passed in: ``causal`` = _causal_rows(seg) [seg, seg], ``zeros`` a zero
    block [Hkv, seg, D]. TorchScript-compilable (decode_step.py runs it inside the scripted decode step)."""
    hq, d = q.shape[1], q.shape[2]
    n, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    rows = g + (-g) % 4                                               # flash rows per call: a multiple of 4
    qq = q.view(1, hkv, g, d)
    if rows > g:
        qq = torch.cat([qq, qq[:, :, -1:].expand(1, hkv, rows - g, d)], 2)
    nb = q0 // seg
    a = nb * seg
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    if nb > 0:
        kb = k[:a].view(nb, seg, hkv, d).permute(0, 2, 1, 3)          # [nb, Hkv, seg, D] (strided view)
        vb = v[:a].view(nb, seg, hkv, d).permute(0, 2, 1, 3)
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qq.expand(nb, -1, -1, -1), kb, vb,
                                                                        scale=scale)
        outs.append(r[0])
        lses.append(r[1])
    pad = zeros[:, : seg - (n - a)]
    ks = torch.cat([k[a:].permute(1, 0, 2), pad], 1).unsqueeze(0)     # [1, Hkv, seg, D]: the open segment, padded
    vs = torch.cat([v[a:].permute(1, 0, 2), pad], 1).unsqueeze(0)
    mask = causal[q0 - a : q0 - a + 1].expand(rows, seg)[None, None]
    r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qq, ks, vs, attn_mask=mask, scale=scale)
    outs.append(r[0])
    lses.append(r[1])
    o = torch.cat(outs)[:, :, :g] if nb > 0 else r[0][:, :, :g]        # [nseg, Hkv, G, D]
    lse = torch.cat(lses)[:, :, :g] if nb > 0 else r[1][:, :, :g]      # [nseg, Hkv, G]
    w = torch.exp(lse - lse.amax(0))
    num = torch.zeros(hkv, g, d, dtype=torch.float32, device=q.device)
    den = torch.zeros(hkv, g, dtype=torch.float32, device=q.device)
    for si in range(nb + 1):                                          # segment order, as _segmented_attention
        num.addcmul_(o[si], w[si].unsqueeze(-1))
        den.add_(w[si])
    return num.div_(den.unsqueeze(-1)).to(q.dtype).view(1, hq, d)


def paged_attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttnMetadata, scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """THE attention seam: new-token queries against the paged cache (which already holds k_new/v_new).

    q:       [N, Hq, D]    queries of the new tokens (RoPE applied)
    k_new:   [N, Hkv, D]   keys of the new tokens (also written to the cache; passed to avoid re-reading it)
    v_new:   [N, Hkv, D]
    k_cache: [num_blocks, BLOCK_SIZE, Hkv, D]  (vLLM NHD layout), v_cache likewise; int8 / fp8 when quantized,
             uint8 [num_blocks, BLOCK_SIZE, Hkv, D // 2] for packed int4
    scales:  (k_scale, v_scale), each [num_blocks, BLOCK_SIZE, Hkv] fp16 (int4: [..., Hkv, D // 32]), for a
             quantized cache; else None
    returns  [N, Hq, D] in q's dtype
    """
    if scales is not None and is_rotated(format_of(k_cache)):
        # int4 stores K/V rotated, quantize(k @ R) (quant_kv.reference): attend in the rotated basis, where
        # q.k = (qR).(kR), and un-rotate the output, o = (P V R) R^T. Row-wise (exact butterflies): chunking-invariant.
        o = _attention(rotate(q), rotate(k_new), rotate(v_new), k_cache, v_cache, meta, scales)
        return unrotate(o)
    return _attention(q, k_new, v_new, k_cache, v_cache, meta, scales)


def _attention(q: Tensor, k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor,
               meta: AttnMetadata, scales: tuple[Tensor, Tensor] | None) -> Tensor:
    """paged_attention in the basis the cache stores (shapes as there)."""
    if meta.attend is not None:
        return meta.attend(q, k_new, v_new, k_cache, v_cache, meta, scales)
    n_tok, hq, d = q.shape
    hkv = k_new.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    ks, vs = scales if scales is not None else (None, None)
    cpu = chunking_invariant(q.device)
    if meta.kind == "decode" and ks is not None and vs is not None and (not cpu or meta.quant_decode_dispatch):
        return dispatch.quant_paged_decode(q, k_cache, v_cache, ks, vs, meta.block_tables, meta.seq_lens,
                                           sm_scale=scale, check_tables=False)
    if meta.kind == "decode" and meta.decode_kernel is not None:
        return meta.decode_kernel(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    if meta.kind == "decode":
        out = torch.empty_like(q)
        for b, s in enumerate(meta.seq_lens_list):
            if cpu and meta.rows_attention and ks is None:   # the row attention a prefill runs, for this row
                out[b] = torch.ops.modeld.rows_attention_cpu(q[b : b + 1], k_cache, v_cache, meta.block_tables[b],
                                                             s - 1, scale)[0]
                continue
            if cpu:   # the same computation a prefill does for this row (chunking-invariant; exact reuse)
                kb, vb = _past_float(k_cache, ks, meta, s, q.dtype, b), _past_float(v_cache, vs, meta, s, q.dtype, b)
                out[b] = _segmented_attention(q[b : b + 1], kb, vb, s - 1, scale)[0]
                continue
            k = _past_kv(k_cache, meta, b, s).to(q.dtype).permute(1, 0, 2)  # k: [Hkv, S, D] (strided view)
            v = _past_kv(v_cache, meta, b, s).to(q.dtype).permute(1, 0, 2)
            qb = q[b].view(hkv, g, d)                                        # q: [Hkv, G, D], head = kv*G + g
            out[b] = F.scaled_dot_product_attention(qb.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                    scale=scale).view(hq, d)
        return out

    # prefill: one session, T = n_tok new tokens after `past` cached ones
    t = n_tok
    past = meta.seq_lens_list[0] - t
    if meta.sparse is not None:
        sp = meta.sparse
        ka, va = k_new, v_new                                                # k, v: [past + T, Hkv, D]
        if past:  # keys read back from the cache (new rows included), as the dense CPU path reads them
            ka = _past_float(k_cache, ks, meta, past + t, q.dtype)
            va = _past_float(v_cache, vs, meta, past + t, q.dtype)
        o, info = dispatch.sparse_prefill(q, ka, va, block_size=sp["block_size"], sm_scale=scale,
                                          keep_ratio=sp["keep_ratio"], max_keep_tokens=sp["max_keep_tokens"],
                                          min_tokens=sp["min_tokens"],
                                          max_density=sp["max_density"], return_info=True)
        meta.sparse_log.append(info)
        return o
    if cpu and meta.rows_attention and ks is None:
        # cpu.c's row attention, in place through the block table: each row's bits depend on its position only
        # (through its torch op, so a profile names it)
        return torch.ops.modeld.rows_attention_cpu(q, k_cache, v_cache, meta.block_tables[0], past, scale)
    if cpu:
        # keys read back from the cache (the new rows included): a quantized cache attends what it stores, the same
        # values a later chunk or a decode step will read, so the result does not depend on the chunking
        kall = _past_float(k_cache, ks, meta, past + t, q.dtype)
        vall = _past_float(v_cache, vs, meta, past + t, q.dtype)
        return _segmented_attention(q, kall, vall, past, scale)
    # generic path (CUDA, old torch): one masked SDPA over past + new
    qh = q.transpose(0, 1).unsqueeze(0)                                      # q: [1, Hq, T, D]
    kn = k_new.transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)          # k: [1, Hq, T, D]
    vn = v_new.transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)
    if past == 0:
        o = F.scaled_dot_product_attention(qh, kn, vn, is_causal=True, scale=scale)
    else:
        kp = _past_float(k_cache, ks, meta, past, q.dtype).transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)
        vp = _past_float(v_cache, vs, meta, past, q.dtype).transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)
        mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)  # [T, S]: key j <= past+i
        o = F.scaled_dot_product_attention(qh, torch.cat([kp, kn], 2), torch.cat([vp, vn], 2),
                                           attn_mask=mask, scale=scale)
    return o.squeeze(0).transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Modules


_PACKABLE = (torch.float32, torch.bfloat16)


_PACK_REFUSED: dict[torch.dtype, str | None] = {}


def pack_refused(dtype: torch.dtype) -> str | None:
    """Why this torch on this CPU cannot multiply ``dtype`` by a oneDNN-packed weight (``RowLinear.pack``), or None
    when it can. Tried once per dtype on a small weight, not read off a CPU flag: oneDNN packs bf16 only with
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and says so by raising (an AVX2-only CPU, such as a VM that hides its
    AVX-512)."""
    if dtype not in _PACK_REFUSED:
        why: str | None = None
        if dtype not in _PACKABLE:
            why = f"{str(dtype).removeprefix('torch.')}: oneDNN packing is tried for fp32 and bf16 only"
        elif not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                  and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            why = "this torch has no oneDNN packed linear"
        else:
            try:
                w = torch.ones(16, 16, dtype=dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
                torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype), packed, None, "none", [], "")
            except RuntimeError as e:
                why = f"{str(dtype).removeprefix('torch.')}: oneDNN cannot pack on this CPU ({str(e).splitlines()[0]})"
        _PACK_REFUSED[dtype] = why
    return _PACK_REFUSED[dtype]


def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """This torch, on this CPU, can multiply ``dtype`` by a oneDNN-packed weight (``RowLinear.pack``)."""
    return pack_refused(dtype) is None


class RowLinear(nn.Linear):
    """nn.Linear that never multiplies a single row on CPU: BLAS takes a GEMV path for M == 1 whose sums round
    differently from the GEMM a prefill chunk uses, so a decoded token's K/V would differ from the same token's K/V
    prefilled later. Two rows (the row twice) take the GEMM path; M >= 2 rows are independent of each other.

    ``pack()`` replaces the weight by oneDNN's blocked copy of it (the layout torch.compile's CPU freezing gives a
    Linear): a plain weight is reordered into that layout inside every call, measured at 2-3x the multiply itself for
    a decode step's few rows on cold weights (docs/cell-benchmarks.md). A packed weight's rows are multiplied alone,
    as the quantized kernels' are: the start-up probe (probe_chunking_invariance) measures that one row gets the bits
    of a 512-row call. Where it does not (oneDNN's bf16 kernels with AMX differ by row count), ``tile`` makes every
    call fixed-size row blocks (row_linear) and the probe runs again; the loader unpacks when that fails too."""

    packed: Tensor | None
    tile: int                 # > 0: every call multiplies fixed ``tile``-row blocks (row_linear); 0: the rows as given

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.register_buffer("packed", None, persistent=False)
        self.tile = 0

    def pack(self) -> bool:
        """Hold the weight packed (and no plain copy); False when it stays plain (not a CPU fp32/bf16 weight)."""
        w = self.weight
        if self.packed is not None or w is None or w.device.type != "cpu" or not can_pack(w.dtype):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 2)
        self.weight = None                                # type: ignore[assignment]
        return True

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        """A packed module's state_dict still holds its ``weight``, plain (a copy out of the packed layout)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None:
            destination[prefix + "weight"] = self.packed.to_dense()

    def unpack(self) -> None:
        if self.packed is not None:
            self.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
            self.packed = None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return row_linear(x, self.packed, self.bias, True, self.tile)
        return row_linear(x, self.weight, self.bias, False, self.tile)


def _mm(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool) -> Tensor:
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none",
                                                  torch.jit.annotate(list[int | float | complex | None], []), "")
    return F.linear(x, weight, bias)


def row_linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: bool, tile: int = 0) -> Tensor:
    """RowLinear's multiply (TorchScript-compilable): x [N, in] @ weight^T (+ bias), one CPU row multiplied as two;
    ``packed``: weight is oneDNN's blocked copy (RowLinear.pack). ``tile`` > 0: the rows go through calls of exactly
    ``tile`` rows, the last block padded with zero rows, so every row meets the same kernel whatever the size of
    its call (a CPU whose kernel differs by row count, bf16 with AMX: tile_linears)."""
    n = x.shape[0]
    if tile > 0:
        pad = (tile - n % tile) % tile
        if pad > 0:
            x = torch.cat([x, x.new_zeros([pad, x.shape[1]])])
        ys: list[Tensor] = []
        for i in range(0, n + pad, tile):
            ys.append(_mm(x[i : i + tile], weight, bias, packed))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return y[:n] if pad > 0 else y
    one = n == 1 and x.device.type == "cpu"
    if one:
        x = torch.cat([x, x])
    y = _mm(x, weight, bias, packed)
    return y[:1] if one else y


def pack_linears(model: Transformer) -> int:
    """Pack every transformer-layer RowLinear of a CPU model (not the head: a tied head is the embedding table, which
    lookups read plain). Returns how many were packed; the model's ``weights_layout`` then says so."""
    if not can_pack(model.compute_dtype):
        return 0
    n = sum(int(m.pack()) for layer in model.layers for m in layer.modules() if isinstance(m, RowLinear))
    if n:
        model.weights_layout = f"{getattr(model, 'weights_layout', 'dense')}; oneDNN-packed: {n}"
    return n


# The row tile tile_linears sets where a CPU's packed kernel rounds a row by its call's row count (what each tile
# costs in prefill and decode, measured on an AMX Xeon: docs/cell-benchmarks.md, 2026-12-05).
ROW_TILE = 32


def tile_linears(model: Transformer, tile: int) -> None:
    """Set every transformer-layer RowLinear's row tile (0: off); the model's ``weights_layout`` says so, since what
    a tile computes is part of every K/V bit (the cache identity carries the layout)."""
    for layer in model.layers:
        for m in layer.modules():
            if isinstance(m, RowLinear):
                m.tile = tile
    layout = getattr(model, "weights_layout", "dense").split("; row tile")[0]
    model.weights_layout = layout + (f"; row tile {tile}" if tile else "")


def settle_packed_rows(linears: list[RowLinear], probe: Any) -> tuple[int, str | None, str | None]:
    """Packed ``linears`` as a CPU cell serves them, decided by ``probe()`` (None: rows invariant, else what
    differed): untiled when it passes; else in ``ROW_TILE``-row tiles when it passes with them; else unpacked and
    untiled. Returns (tile, what the untiled probe found, why packing was refused). loader.pack_and_probe and the
    autotune measurement both go through this, so they time and serve the same layout."""
    untiled = probe()
    if untiled is None:
        return 0, None, None
    for lin in linears:
        lin.tile = ROW_TILE
    tiled = probe()
    if tiled is None:
        return ROW_TILE, untiled, None
    for lin in linears:
        lin.tile = 0
        lin.unpack()
    return 0, untiled, f"{untiled}; in {ROW_TILE}-row tiles: {tiled}"


def unpack_linears(model: Transformer) -> None:
    for m in model.modules():
        if isinstance(m, RowLinear):
            m.unpack()
    layout = getattr(model, "weights_layout", None)
    if layout is not None and "; oneDNN-packed" in layout:
        model.weights_layout = layout.split("; oneDNN-packed")[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, normalised in fp32 (bf16 variance loses ~3 digits); TorchScript-compilable."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_frequencies(args: ModelArgs) -> Tensor:
    """inv_freq: [D/2] fp32, with linear or llama3 scaling applied."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = args.rope_scaling or {}
    kind = sc.get("type") or sc.get("rope_type")
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {sc!r} (supported: linear, llama3)")
    return inv.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [N, H, D]; cos/sin: [N, D] fp32. HF rotate_half convention (first half / second half pairs)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return (xf * cos.unsqueeze(1) + rot * sin.unsqueeze(1)).to(x.dtype)


def rope_rows(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The RoPE tables of a forward's positions as ``rope_rotate`` takes them: cos [N, 1, D] and the sin with
    rotate_half's sign folded in ([-sin | sin] halves) [N, 1, D], built once per forward for every layer."""
    h = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat([-sin[:, :h], sin[:, h:]], -1).unsqueeze(1)


def rope_rotate(x: Tensor, cos: Tensor, ssin: Tensor) -> Tensor:
    """apply_rope in 6 ops instead of 10, the same bits: x * cos + roll(x, D/2) * [-sin | sin] computes
    x1 * c - x2 * s | x2 * c + x1 * s with the same roundings (a product's sign is exact). x: [N, H, D]."""
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * ssin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = RowLinear(args.dim, qkv, bias=args.qkv_bias)  # fused q|k|v: one matmul per layer
        self.wo = RowLinear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Any, meta: AttnMetadata) -> Tensor:
        """cos, sin: the forward's ``rope_rows``."""
        n = x.shape[0]
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)
        qk = rope_rotate(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)   # q and k rotated together
        q, k = qk[:, :hq], qk[:, hq:]                # q: [N, Hq, D]; k: [N, Hkv, D]
        if n > 1:
            q = q.contiguous()
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)  # v: [N, Hkv, D]
        kv.write(self.layer, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, kv.k_layer(self.layer), kv.v_layer(self.layer), meta,
                            kv.scales_layer(self.layer))
        return self.wo(o.reshape(n, hq * d))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.w13 = RowLinear(args.dim, 2 * args.intermediate_size, bias=False)  # fused gate|up
        self.w2 = RowLinear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Any, meta: AttnMetadata) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, kv, meta)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # on the meta device (models.build_model) an init makes no values: skipping it skips torch's Python meta
        # kernel for normal_, whose first call imports dynamo, inductor and sympy (7.6 s a process on a 2-core VM)
        meta = torch.get_default_device().type == "meta"
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim,
                                           _weight=torch.empty(args.vocab_size, args.dim) if meta else None)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = RowLinear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)  # [max_seq_len, D] fp32
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        # intra-op threads the head multiplies with when a step runs at fewer (None: the step's own count); see logits
        self.head_threads: int | None = None
        self.init_rope()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the weights' as loaded, or what a quantized model's kernels compute in."""
        return self.norm.weight.dtype

    def init_rope(self) -> None:
        """(Re)compute the fp32 RoPE tables on the model's device (also after ``to_empty``)."""
        dev = self.norm.weight.device
        if dev.type == "meta":
            return
        ang = torch.outer(torch.arange(self.args.max_seq_len, dtype=torch.float32), rope_frequencies(self.args))
        ang = torch.cat([ang, ang], dim=-1).to(dev)                                   # ang: [S, D]
        self.rope_cos, self.rope_sin = ang.cos(), ang.sin()

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, kv: Any, meta: AttnMetadata,
                logits_rows: Tensor | None = None) -> Tensor:
        """tokens, positions: [N] int64. Returns fp32 logits [len(logits_rows) or N, V]."""
        x = self.tok_embeddings(tokens)                  # x: [N, dim]
        cos, sin = rope_rows(self.rope_cos[positions], self.rope_sin[positions])
        for layer in self.layers:
            x = layer(x, cos, sin, kv, meta)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """fp32 logits of the last hidden states x [N, dim]: the final norm and the head. A one-session decode step
        may run its ~3,000 small layer ops on one thread (TorchRunner.choose_decode_threads), but the head is one
        streaming read of the whole [V, dim] matrix (56 MiB at bf16 for SmolLM2), which a single thread reads at
        about half the speed two do; with ``head_threads`` set the head runs at that count. Each output element is
        one row's dot product either way, and the step that takes one thread is checked against the process
        count's logits bit for bit."""
        n = self.head_threads
        was = torch.get_num_threads()
        if n is None or n == was:
            return self.output(self.norm(x)).float()
        torch.set_num_threads(n)
        try:
            return self.output(self.norm(x)).float()
        finally:
            torch.set_num_threads(was)

    # ---- weights

    def load_hf_state_dict(self, sd: dict[str, Tensor], dtype: torch.dtype) -> None:
        """Load HF-named weights (``model.layers.{i}.self_attn.q_proj.weight`` ...), fusing q|k|v and gate|up.

        Every model parameter must be provided; unknown names are an error (a silent miss would load garbage).
        """
        a = self.args
        used: set[str] = set()

        def take(name: str) -> Tensor:
            if name not in sd:
                raise KeyError(f"checkpoint lacks {name}")
            used.add(name)
            return sd[name]

        new: dict[str, Tensor] = {"tok_embeddings.weight": take("model.embed_tokens.weight"),
                                  "norm.weight": take("model.norm.weight")}
        if not a.tie_embeddings:
            new["output.weight"] = take("lm_head.weight")
        elif "lm_head.weight" in sd:
            used.add("lm_head.weight")  # some tied checkpoints still carry a copy
        for i in range(a.n_layers):
            p, m = f"model.layers.{i}.", f"layers.{i}."
            new[m + "attention_norm.weight"] = take(p + "input_layernorm.weight")
            new[m + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
            new[m + "attention.wqkv.weight"] = torch.cat(
                [take(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0)
            if a.qkv_bias:
                new[m + "attention.wqkv.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"], 0)
            new[m + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
            new[m + "feed_forward.w13.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
            new[m + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
        extra = sorted(set(sd) - used - {k for k in sd if "rotary_emb.inv_freq" in k})
        if extra:
            raise KeyError(f"checkpoint has weights this model does not use: {extra[:5]}")
        own = dict(self.named_parameters())
        for name, t in new.items():
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(own[name].shape)}")
        missing = set(own) - set(new) - ({"output.weight"} if a.tie_embeddings else set())
        if missing:
            raise KeyError(f"model parameters not in checkpoint: {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, t in new.items():
                own[name].data = t.to(device=own[name].device, dtype=dtype).contiguous()   # stays on the model's device
            if a.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
        # buffers (RoPE tables) stay fp32: positions up to 128k need more than bf16's 8 bits of mantissa
