"""The scripted decode step (decode_step.py) computes the eager step's bits, and the runner takes it only when it
does (#18). A tiny random model over every linear kind the step multiplies (plain, oneDNN-packed, packed in fixed
row tiles, int8, int4), both
compute dtypes, consecutive and scattered block tables, and positions past the first 512-key attention segment.
Mechanisms only: which step is faster is measured at start and never asserted here."""

from __future__ import annotations

import pytest
import torch

from modeld_cell import decode_step as DS
from modeld_cell import errors
from modeld_cell import model as M
from modeld_cell.config import EngineSettings
from modeld_cell.kernels.paged_decode import cpu as cpu_attention
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.quantize import quantize_model
from modeld_cell.runner import TorchRunner

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(M._FLASH_CPU is None, reason="this torch has no CPU flash attention with LSE")]

CONTEXT = 520                        # past ATTN_SEGMENT (512): the step's whole-segment flash call runs too


def _model(kind: str, dtype: torch.dtype, bias: bool = False) -> M.Transformer:
    args = M.ModelArgs(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_seq_len=1024, tie_embeddings=True, qkv_bias=bias)
    torch.manual_seed(0)
    m = M.Transformer(args).eval()
    if kind in ("int8", "q4_1"):
        return quantize_model(m, kind, dtype)
    m = m.to(dtype)
    if kind in ("packed", "packed-tiled"):
        assert M.pack_linears(m) == 8
    if kind == "packed-tiled":                      # as the loader serves packed rows a kernel rounds by call size
        M.tile_linears(m, 8)
    return m


def _runner(m: M.Transformer, kv_fmt: str = "fp32") -> TorchRunner:
    a = m.args
    kv = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(kv_fmt), 1 << 22, 16)
    return TorchRunner(m, kv)


def _two_sessions(r: TorchRunner) -> tuple[list[int], list[int], int]:
    """The same CONTEXT tokens prefilled into a scattered block table (a, ids in reverse) and a consecutive one (b),
    room for 4 more; returns a, b and the last token."""
    nblk = r.kv.blocks_for(CONTEXT + 4)
    a, b = r.kv.allocate(nblk)[::-1], r.kv.allocate(nblk)
    toks = [(i * 31 + 7) % r.model.args.vocab_size for i in range(CONTEXT)]
    r.prefill(toks, 0, a)
    r.prefill(toks, 0, b)
    return a, b, toks[-1]


def _kv_of(r: TorchRunner, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return r.kv.k[:, blocks].clone(), r.kv.v[:, blocks].clone()


CASES = [("plain", torch.float32), ("plain", torch.bfloat16), ("packed", torch.float32), ("packed", torch.bfloat16),
         ("packed-tiled", torch.float32), ("packed-tiled", torch.bfloat16), ("int8", torch.float32), ("int8", torch.bfloat16), ("q4_1", torch.float32), ("q4_1", torch.bfloat16)]


@pytest.mark.parametrize("scattered", [False, True], ids=["blocks-consecutive", "blocks-scattered"])
@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=[f"{k}-{str(d).removeprefix('torch.')}" for k, d in CASES])
def test_the_scripted_step_writes_and_returns_the_eager_bits(kind: str, dtype: torch.dtype, scattered: bool) -> None:
    if kind.startswith("packed") and not M.can_pack(dtype):
        pytest.skip(str(M.pack_refused(dtype)))
    m = _model(kind, dtype, bias=scattered)        # Qwen2's q/k/v bias rides along with one of the two tables
    r = _runner(m, "bf16" if dtype == torch.bfloat16 else "fp32")
    assert DS.eligible(m, r.kv) is None
    step = DS.ScriptedDecode(m, r.kv)
    nblk = r.kv.blocks_for(CONTEXT + 4)
    a, b = r.kv.allocate(nblk), r.kv.allocate(nblk)
    if scattered:                                   # a block table that is not one run of ids
        a, b = a[::-1], b[1:] + b[:1]
    toks = [(i * 31 + 7) % m.args.vocab_size for i in range(CONTEXT)]
    r.prefill(toks, 0, a)
    r.prefill(toks, 0, b)
    ta = tb = toks[-1]
    for i in range(3):
        pos = CONTEXT + i
        eager = r.decode([ta], [pos], [a])          # runner.decode_step is None: model.forward
        scripted = step(tb, pos, b)
        assert scripted.dtype == torch.float32 and scripted.shape == eager.shape == (1, m.args.vocab_size)
        assert torch.equal(scripted, eager), f"step {i}: logits differ"
        ta = tb = int(eager[0].argmax())
    for x, y in zip(_kv_of(r, a), _kv_of(r, b), strict=True):
        assert torch.equal(x, y)                    # every layer's K/V, the decoded tokens' included


def test_the_runner_takes_the_step_only_with_equal_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _runner(_model("plain", torch.float32))
    rep = r.choose_decode_step("script", reps=2)
    assert r.decode_step is not None and rep["step"] == "torchscript" and rep["bitwise_equal"] is True
    assert set(rep["median_ms"]) == {"eager", "script"} and r.kv.used_blocks == 0
    rep = r.choose_decode_step("auto", reps=2)      # taken or not by its speed here; the report says which
    assert rep["bitwise_equal"] is True and (r.decode_step is not None) == (rep["step"] == "torchscript")

    real = DS.ScriptedDecode.__call__

    def off_by_a_bit(self, tok, pos, table):  # type: ignore[no-untyped-def]
        out = real(self, tok, pos, table)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(DS.ScriptedDecode, "__call__", off_by_a_bit)
    rep = r.choose_decode_step("auto", reps=2)
    assert r.decode_step is None and rep["step"] == "eager" and rep["bitwise_equal"] is False
    assert "bits differ" in rep["reason"]
    with pytest.raises(errors.Fatal, match="MODELD_DECODE_STEP=script, but the scripted step's bits differ"):
        r.choose_decode_step("script", reps=2)


def test_the_runner_uses_the_taken_step_for_one_session_only() -> None:
    r = _runner(_model("plain", torch.float32))
    r.choose_decode_step("script", reps=1)
    calls = []
    real = r.decode_step

    def counted(tok, pos, table):  # type: ignore[no-untyped-def]
        calls.append(pos)
        return real(tok, pos, table)

    r.decode_step = counted
    a, b = r.kv.allocate(2), r.kv.allocate(2)
    r.prefill([1, 2, 3], 0, a)
    r.prefill([4, 5, 6], 0, b)
    one = r.decode([7], [3], [a])
    assert calls == [3] and one.shape == (1, 96)
    two = r.decode([8, 9], [4, 3], [a, b])          # a batch: the eager forward
    assert calls == [3] and two.shape == (2, 96)


def test_what_the_step_cannot_serve_decodes_eagerly_with_the_reason() -> None:
    r = _runner(_model("plain", torch.float32), kv_fmt="int8")
    rep = r.choose_decode_step("auto")
    assert r.decode_step is None and "quantized (int8)" in rep["reason"]
    rep = r.choose_decode_step("script")          # forced, but this cell cannot take it: eager, not a stopped worker
    assert r.decode_step is None and rep["step"] == "eager" and "quantized (int8)" in rep["reason"]
    r = _runner(_model("plain", torch.float32))
    assert r.choose_decode_step("eager")["reason"] == "MODELD_DECODE_STEP=eager" and r.decode_step is None
    m = _model("plain", torch.float32)
    m.layers[1].feed_forward.w2 = torch.nn.Linear(128, 64, bias=False)
    assert DS.eligible(m, _runner(m).kv) == "layer 1 w2 is a Linear"


def test_a_sibling_pool_adopts_the_measured_step_after_checking_its_own_bits() -> None:
    m = _model("plain", torch.float32)
    r = _runner(m, kv_fmt="bf16")
    rep = r.choose_decode_step("auto", 1, 64, "the base engine")
    assert r.decode_step is not None and rep["bitwise_equal"] is True
    assert rep["reason"] == "the scripted step has the eager bits and the base engine measured it faster"
    r = _runner(m, kv_fmt="int8")                    # cannot serve: eager, and no error for a sibling
    assert r.choose_decode_step("script", 1, 64, "the base engine")["step"] == "eager" and r.decode_step is None


@pytest.mark.parametrize("var, attr, given, read, bad, refusal", [
    ("MODELD_DECODE_STEP", "decode_step", "Script", "script", "compiled", "auto, script or eager"),
    ("MODELD_DECODED_KV", "decoded_kv", " Recompute", "recompute", "fast", "auto, exact or recompute"),
    ("MODELD_CPU_KERNELS", "cpu_kernels", " On", "on", "yes", "auto, on or off"),
])
def test_the_step_settings_are_read_and_checked(monkeypatch: pytest.MonkeyPatch, var: str, attr: str, given: str,
                                                read: str, bad: str, refusal: str) -> None:
    monkeypatch.delenv(var, raising=False)
    assert getattr(EngineSettings.from_env(), attr) == "auto"
    monkeypatch.setenv(var, given)
    assert getattr(EngineSettings.from_env(), attr) == read
    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=f"{var} must be {refusal}"):
        EngineSettings.from_env()


# ---- the recomputing step (MODELD_DECODED_KV): the same function, other roundings; chosen by what it saves

def _kernel() -> None:
    """The CPU paged-decode kernel loaded (built into a temporary directory once a process), or the test skipped
    where this machine has no C compiler (the worker then serves the flash call, saying why)."""
    if cpu_attention._compiler() is None:
        pytest.skip("no C compiler on PATH: the worker leaves the CPU kernel off")
    rep = cpu_attention.load(None)
    assert rep["loaded"], rep["reason"]


@pytest.mark.parametrize("kernel", [False, True], ids=["flash", "cpu-kernel"])
@pytest.mark.parametrize(("kind", "dtype"), [("plain", torch.float32), ("packed", torch.float32),
                                             ("packed-tiled", torch.bfloat16), ("q4_1", torch.float32)],
                         ids=["plain-fp32", "packed-fp32", "packed-tiled-bf16", "q4_1-fp32"])
def test_the_recomputing_step_computes_the_eager_function_within_rounding(kind: str, dtype: torch.dtype,
                                                                          kernel: bool) -> None:
    """Past the first 512-key segment, over a scattered block table: the recomputing step's logits and the K/V it
    writes are the eager step's up to rounding (bf16: a few of its ulps over two layers), never another function;
    with its attention by torch's flash call or by the CPU paged-decode kernel reading the pages in place."""
    if kind.startswith("packed") and not M.can_pack(dtype):
        pytest.skip(str(M.pack_refused(dtype)))
    if kernel:
        _kernel()
    m = _model(kind, dtype)
    r = _runner(m, "bf16" if dtype == torch.bfloat16 else "fp32")
    fast = DS.ScriptedDecode(m, r.kv, exact=False, kernel=kernel)
    a, b, tok = _two_sessions(r)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    for i in range(3):
        pos = CONTEXT + i
        eager = r.decode([tok], [pos], [b])
        got = fast(tok, pos, a)
        assert got.shape == eager.shape == (1, m.args.vocab_size) and got.dtype == torch.float32
        torch.testing.assert_close(got, eager, **tol)
        tok = int(eager[0].argmax())
    for x, y in zip(_kv_of(r, a), _kv_of(r, b), strict=True):
        torch.testing.assert_close(x.float(), y.float(), **tol)


def test_one_call_row_is_softmax_attention_over_every_key() -> None:
    """The recomputing step's attention against the textbook formula: each of 4 query heads attends to its KV head
    (2 query heads per KV head), over every key, no mask."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, 4, 16), (700, 2, 16), (700, 2, 16)))
    scale = 0.25
    got = DS.one_call_row(q, k, v, scale)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)        # [n, 4, D]: query head h -> h // 2
    w = torch.softmax(torch.einsum("hd,nhd->hn", q[0], kk) * scale, -1)
    torch.testing.assert_close(got[0], torch.einsum("hn,nhd->hd", w, vv), rtol=1e-5, atol=1e-5)


class _Priced(TorchRunner):
    """A runner whose prefill costs ``prefill_ms`` a token and whose one-session step takes ``exact_ms`` or
    ``recompute_ms`` by which step serves (``kernel_ms`` the recomputing step with the CPU kernel, else as
    recompute_ms), returning ``logits`` of either (choose_decoded_kv's logic)."""

    def __init__(self, exact_ms: float, recompute_ms: float, prefill_ms: float,
                 logits: dict[str, list[float]] | None = None, kernel_ms: float | None = None,
                 layers_ms: float | None = None, q4_ms: float | None = None) -> None:
        super().__init__(_model("plain", torch.float32), PagedKVCache(2, 2, 16, kv_format("fp32"), 1 << 22, 16))
        self.exact_ms, self.recompute_ms, self.prefill_ms = exact_ms, recompute_ms, prefill_ms
        self.kernel_ms = recompute_ms if kernel_ms is None else kernel_ms
        self.layers_ms = self.kernel_ms if layers_ms is None else layers_ms
        self.q4_ms = self.layers_ms if q4_ms is None else q4_ms
        self.stated = logits or {"exact": [0.0, 1.0, 2.0], "recompute": [0.0, 1.0, 2.0]}

    def prefill(self, tokens, start, blocks, sparse=None):  # type: ignore[no-untyped-def]
        import time
        time.sleep(len(tokens) * self.prefill_ms / 1e3)
        return torch.zeros(3), 0.0, []

    def decode(self, toks, positions, tables):  # type: ignore[no-untyped-def]
        import time
        kind = "exact" if self.writes_exact(len(toks)) else "recompute"
        step = self.recompute_step
        ms = self.exact_ms if kind == "exact" else (self.q4_ms if step.blocks is not None else self.layers_ms) \
            if isinstance(step, DS.KernelDecode) else self.kernel_ms if step.kernel else self.recompute_ms
        time.sleep(ms / 1e3)
        return torch.tensor([self.stated[kind]])


def test_decoded_kv_recomputes_where_the_step_saves_more_than_the_recompute_costs() -> None:
    """The test's own prices: a 12 ms exact step against a 4 ms recomputing one saves 8 ms a token, more than
    0.1 ms a prefilled token: taken; saving 1 ms against 3 ms a prefilled token: not."""
    r = _Priced(exact_ms=12.0, recompute_ms=4.0, prefill_ms=0.1)
    rep = r.choose_decoded_kv("auto", reps=3, context=32, kernels="off")
    assert r.decoded_kv == "recompute" and r.recompute_step is not None and rep["decoded_kv"] == "recompute"
    assert rep["saved_ms"] > rep["prefill_ms_per_token"] and rep["kl"] == 0.0 and r.kv.used_blocks == 0
    assert not r.writes_exact(1) and r.writes_exact(2)        # batched steps stay exact
    r = _Priced(exact_ms=5.0, recompute_ms=4.0, prefill_ms=3.0)
    rep = r.choose_decoded_kv("auto", reps=3, context=8, kernels="off")
    assert r.decoded_kv == "exact" and r.recompute_step is None and r.writes_exact(1)
    assert "not more than recomputing it costs" in rep["reason"]


def test_decoded_kv_refuses_a_step_whose_logits_are_another_function() -> None:
    r = _Priced(exact_ms=12.0, recompute_ms=4.0, prefill_ms=0.1,
                logits={"exact": [0.0, 0.0, 9.0], "recompute": [9.0, 0.0, 0.0]})
    rep = r.choose_decoded_kv("auto", reps=3, context=32, kernels="off")
    assert r.decoded_kv == "exact" and rep["kl"] > TorchRunner.RECOMPUTE_KL_MAX and "(KL)" in rep["reason"]


def test_decoded_kv_settings_and_what_cannot_recompute() -> None:
    r = _runner(_model("plain", torch.float32))
    assert r.choose_decoded_kv("exact")["reason"] == "MODELD_DECODED_KV=exact" and r.writes_exact(1)
    rep = r.choose_decoded_kv("recompute", kernels="off")               # untimed
    assert r.decoded_kv == "recompute" and "median_ms" not in rep and not r.writes_exact(1)
    assert rep["attention"] == {"served": "flash", "reason": "MODELD_CPU_KERNELS=off"}
    blocks = r.kv.allocate(2)
    r.prefill([1, 2, 3], 0, blocks)
    assert r.decode([4], [3], [blocks]).shape == (1, 96)   # served by the recomputing step
    r = _runner(_model("plain", torch.float32), kv_fmt="int8")
    rep = r.choose_decoded_kv("recompute")
    assert r.decoded_kv == "exact" and "quantized (int8)" in rep["reason"]


def test_the_recomputing_step_takes_the_cpu_kernels_where_they_were_measured_faster() -> None:
    """The test's own prices: of the flash call's step (8 ms), the kernel's (4 ms) and the whole-layer C step's
    (2 ms), the fastest is served, timed at the attention context (the tier's last position here), and the exact
    step is then measured against it; the others in their turn where they are the fastest. "on" takes the
    whole-layer step untimed, where the weights are plain (here), else the kernel's."""
    _kernel()
    r = _Priced(exact_ms=24.0, recompute_ms=8.0, kernel_ms=4.0, layers_ms=2.0, prefill_ms=0.1)
    rep = r.choose_decoded_kv("auto", reps=3, context=32)
    att = rep["attention"]
    assert r.decoded_kv == "recompute" and isinstance(r.recompute_step, DS.KernelDecode) and att["served"] == "layers"
    assert set(att["median_ms"]) == {"flash", "kernel", "layers"} and att["build"]["loaded"] and att["context"] == 1023
    assert att["reason"].startswith("after 1023 tokens the layers step took") and "kernel " in att["reason"]
    assert rep["saved_ms"] == round(rep["median_ms"]["exact"] - rep["median_ms"]["recompute"], 2)
    assert rep["median_ms"]["recompute"] < 8.0 and r.kv.used_blocks == 0
    r = _Priced(exact_ms=12.0, recompute_ms=4.0, kernel_ms=2.0, layers_ms=6.0, prefill_ms=0.1)
    rep = r.choose_decoded_kv("recompute", reps=3, context=32)
    assert type(r.recompute_step) is DS.ScriptedDecode and r.recompute_step.kernel
    assert rep["attention"]["served"] == "kernel"
    r = _Priced(exact_ms=12.0, recompute_ms=4.0, kernel_ms=6.0, layers_ms=7.0, prefill_ms=0.1)
    rep = r.choose_decoded_kv("recompute", reps=3, context=32)
    assert not r.recompute_step.kernel and rep["attention"]["served"] == "flash"
    assert "the flash step took" in rep["attention"]["reason"] and "median_ms" not in rep
    rep = r.choose_decoded_kv("recompute", kernels="on")
    assert isinstance(r.recompute_step, DS.KernelDecode) and rep["attention"]["reason"] == "MODELD_CPU_KERNELS=on"
    assert "median_ms" not in rep["attention"]


def test_the_kernel_step_without_plain_weights_says_why_and_the_scripted_kernel_serves() -> None:
    _kernel()
    m = _model("q4_1", torch.float32)
    r = _runner(m)
    rep = r.choose_decoded_kv("recompute", kernels="on")
    assert type(r.recompute_step) is DS.ScriptedDecode and r.recompute_step.kernel
    assert rep["attention"]["served"] == "kernel"
    assert rep["attention"]["layers"] == "layer 0 wqkv is a Int4WeightOnlyLinear: the layer step multiplies plain " \
                                         "dense weights"


def test_the_cpu_kernel_required_but_not_loadable_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "load", lambda cache_dir: {"loaded": False, "reason": "no C compiler on PATH"})
    monkeypatch.setattr(cpu_attention, "_lib", None)
    r = _runner(_model("plain", torch.float32))
    with pytest.raises(errors.Fatal, match="MODELD_CPU_KERNELS=on, but no C compiler on PATH"):
        r.choose_decoded_kv("recompute", kernels="on")
    rep = r.choose_decoded_kv("recompute")             # auto: the flash call serves, with the reason
    assert r.decoded_kv == "recompute" and not r.recompute_step.kernel
    assert rep["attention"]["reason"] == "no C compiler on PATH"


# ---- the whole-layer C step (decode_step.KernelDecode): the recomputing step's function, in one call

def _assert_steps_agree(r: TorchRunner, ref: DS.ScriptedDecode, step: DS.KernelDecode, dtype: torch.dtype,
                        fp32_tol: float = 1e-4) -> None:
    """Three tokens past CONTEXT: ``step`` over a scattered block table against ``ref`` over a consecutive one, the
    logits and the K/V written equal up to rounding (the linears' sums in another order; ``fp32_tol`` in fp32), the
    same tokens picked."""
    a, b, tok = _two_sessions(r)
    tol = {"rtol": fp32_tol, "atol": fp32_tol} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    for i in range(3):
        pos = CONTEXT + i
        want = ref(tok, pos, b)
        got = step(tok, pos, a)
        assert got.shape == want.shape == (1, r.model.args.vocab_size) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, **tol)
        assert int(got.argmax()) == int(want.argmax())
        tok = int(want[0].argmax())
    for x, y in zip(_kv_of(r, a), _kv_of(r, b), strict=True):
        torch.testing.assert_close(x.float(), y.float(), **tol)


@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_the_layer_step_computes_the_recomputing_steps_function(dtype: torch.dtype, threads: int) -> None:
    """Past the first 512-key segment (33 blocks: at two threads the keys are split and merged), over a scattered
    block table against a consecutive one: its logits and the K/V it writes are the scripted kernel step's up to
    rounding (the linears' sums in another order), and it picks the same tokens."""
    _kernel()
    m = _model("plain", dtype)
    r = _runner(m, "bf16" if dtype == torch.bfloat16 else "fp32")
    assert DS.layers_eligible(m, r.kv) is None
    ref = DS.ScriptedDecode(m, r.kv, exact=False, kernel=True)
    step = DS.KernelDecode(m, r.kv, threads)
    _assert_steps_agree(r, ref, step, dtype)


def test_the_layer_step_takes_plain_dense_weights_only_and_follows_the_model() -> None:
    _kernel()
    for kind, why in (("packed", "layer 0 wqkv is oneDNN-packed"), ("int8", "layer 0 wqkv is a Int8WeightOnlyLinear")):
        if kind == "packed" and not M.can_pack(torch.float32):
            continue
        m = _model(kind, torch.float32)
        assert DS.layers_eligible(m, _runner(m).kv).startswith(why)
        with pytest.raises(ValueError, match=why):
            DS.KernelDecode(m, _runner(m).kv)
    m = _model("plain", torch.float32, bias=True)                   # Qwen2's q/k/v bias
    assert "has a bias" in DS.layers_eligible(m, _runner(m).kv)
    m = _model("plain", torch.float32)
    r = _runner(m)
    step = DS.KernelDecode(m, r.kv)
    blocks = r.kv.allocate(2)
    r.prefill([1, 2, 3], 0, blocks)
    assert step(4, 3, blocks).shape == (1, 96)
    if M.can_pack(torch.float32):           # packed since: the pointers it took are stale, and it says so
        M.pack_linears(m)
        with pytest.raises(RuntimeError, match="changed since the layer step was built"):
            step(4, 3, blocks)


def _q4_representable(m: M.Transformer) -> M.Transformer:
    """The model with each layer linear's weights replaced by their Q4_1 values (quantized and dequantized), and its
    head by its Q8_0 values, as a model loaded from a Q4_1 file holds them: its dense weights and its blocks are
    then one set of values."""
    from modeld_cell.quantize import dequantize_q4_1, q8_0_blocks, quantize_q4_1
    with torch.no_grad():
        for layer in m.layers:
            for mod in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
                mod.weight.copy_(dequantize_q4_1(*quantize_q4_1(mod.weight.float())).to(mod.weight.dtype))
        q, d = q8_0_blocks(m.output.weight.float())               # the head (the tied table) as Q8_0 values
        m.output.weight.copy_((q.view(q.shape[0], -1, 32).float() * d[..., None]).view(q.shape).to(m.output.weight.dtype))
    return m


@pytest.mark.parametrize("head", [False, True], ids=["head-dense", "head-q8_0"])
@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_the_q4_layer_step_computes_the_recomputing_steps_function(dtype: torch.dtype, threads: int,
                                                                   head: bool) -> None:
    """Reading the layers' Q4_1 blocks (and the head's Q8_0 ones) instead of their dense copy: past the first
    512-key segment, over a scattered block table against the dense scripted kernel step over a consecutive one, its
    logits and the K/V it writes are that step's up to rounding (the same weight values, sums in another order, and
    the linears' input rows in 16-bit fixed point per 32 values on AVX2), and it picks the same tokens."""
    from modeld_cell.quantize import q8_0_blocks
    _kernel()
    m = _q4_representable(_model("plain", dtype))
    r = _runner(m, "bf16" if dtype == torch.bfloat16 else "fp32")
    blocks = DS.q4_blocks(m)
    assert blocks is not None and len(blocks) == m.args.n_layers and all(len(b) == 4 for b in blocks)
    assert DS.layers_eligible(m, r.kv, blocks) is None
    ref = DS.ScriptedDecode(m, r.kv, exact=False, kernel=True)
    step = DS.KernelDecode(m, r.kv, threads, blocks, q8_0_blocks(m.output.weight.float()) if head else None)
    _assert_steps_agree(r, ref, step, dtype, fp32_tol=1e-3)     # the rows in 16-bit fixed point (cpu.c's xrow)


def test_the_q4_layer_step_reads_its_blocks_whatever_the_dense_layout() -> None:
    """With Q4_1 blocks the dense weights may be oneDNN-packed (for prefill): the step still serves; blocks of
    another shape than a linear, or of another layer count, are refused with the reason."""
    _kernel()
    m = _q4_representable(_model("plain", torch.float32))
    blocks = DS.q4_blocks(m)
    if M.can_pack(torch.float32):
        M.pack_linears(m)
        assert DS.q4_blocks(m) is None                     # packed: no dense weights to make blocks of
    r = _runner(m)
    step = DS.KernelDecode(m, r.kv, 1, blocks)
    tab = r.kv.allocate(2)
    r.prefill([1, 2, 3], 0, tab)
    assert step(4, 3, tab).shape == (1, 96)
    assert DS.layers_eligible(m, r.kv, blocks) is None
    assert DS.layers_eligible(m, r.kv, blocks[:1]) == "1 layers of Q4_1 blocks for a model of 2"
    from modeld_cell.quantize import q8_0_blocks
    with pytest.raises(ValueError, match="Q8_0 head blocks of"):
        DS.KernelDecode(m, r.kv, 1, blocks, q8_0_blocks(torch.randn(95, 64)))
    bad = [list(layer) for layer in blocks]
    bad[1][2] = bad[1][1]                                   # w13's place holds wo's blocks
    assert DS.layers_eligible(m, r.kv, bad) == "layer 1 w13: a bias, or Q4_1 blocks of another shape than the linear"


def test_the_q4_layer_step_is_timed_with_the_others_and_its_blocks_kept_only_where_it_serves() -> None:
    """The test's own prices: with Q4_1 blocks on the model, the runner times the Q4_1 layer step beside the flash,
    kernel and dense layer steps; the fastest serves, and the model keeps its blocks (counted in its weights as
    served) only where that is the Q4_1 step. "on" takes the Q4_1 step untimed."""
    from modeld_cell.quantize import weights_bytes
    _kernel()
    # prices a few ms apart: sleeps of 0.5 against 1 ms swapped places on a loaded 2-core VM (2026-12-07)
    for q4_ms, served in ((2.0, "layers-q4"), (12.0, "layers")):
        r = _Priced(exact_ms=48.0, recompute_ms=16.0, kernel_ms=8.0, layers_ms=4.0, q4_ms=q4_ms, prefill_ms=0.1)
        _q4_representable(r.model)
        dense = weights_bytes(r.model)
        r.model.decode_blocks = DS.q4_blocks(r.model)
        assert weights_bytes(r.model) > dense                   # the blocks are weights as served while held
        rep = r.choose_decoded_kv("auto", reps=3, context=32)
        att = rep["attention"]
        assert set(att["median_ms"]) == {"flash", "kernel", "layers", "layers-q4"} and att["served"] == served
        assert isinstance(r.recompute_step, DS.KernelDecode)
        assert (r.recompute_step.blocks is not None) == (served == "layers-q4")
        assert (r.model.decode_blocks is not None) == (served == "layers-q4")
        assert (weights_bytes(r.model) > dense) == (served == "layers-q4")
    r = _Priced(exact_ms=12.0, recompute_ms=4.0, prefill_ms=0.1)
    r.model.decode_blocks = DS.q4_blocks(_q4_representable(r.model))
    rep = r.choose_decoded_kv("recompute", kernels="on")
    assert rep["attention"]["served"] == "layers-q4" and r.recompute_step.blocks is r.model.decode_blocks
    # a second runner over the same weights (a sibling engine's) that cannot take the blocks leaves them to the first
    sib = TorchRunner(r.model, PagedKVCache(2, 2, 16, kv_format("int8"), 1 << 22, 16))
    sib.choose_decoded_kv("recompute", kernels="auto")
    assert r.model.decode_blocks is r.recompute_step.blocks


def test_the_loader_keeps_dense_weights_plain_only_for_a_faster_layer_step(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path) -> None:
    """loader.keep_plain_for_kernels: never with the kernels off, exact decoded K/V or quantized weights; untimed
    under MODELD_CPU_KERNELS=on; under auto by which one-row multiply of the first layers' linears was faster, at the test's
    own prices (either side slowed by a sleep)."""
    import time as _time

    from modeld_cell import loader
    _kernel()
    m = _model("plain", torch.float32)
    assert loader.keep_plain_for_kernels(m, EngineSettings(cpu_kernels="off"), None) is None
    assert loader.keep_plain_for_kernels(m, EngineSettings(decoded_kv="exact"), None) is None
    assert loader.keep_plain_for_kernels(_model("q4_1", torch.float32), EngineSettings(), None) is None
    if not M.can_pack(torch.float32):
        return
    assert loader.keep_plain_for_kernels(m, EngineSettings(cpu_kernels="on"), None) == (
        "kept plain for the CPU kernels' whole-layer decode step (MODELD_CPU_KERNELS=on)")
    real_gemv, real_mm = cpu_attention.gemv, M._mm

    def slow(fn):  # type: ignore[no-untyped-def]
        def wrapped(*a, **k):  # type: ignore[no-untyped-def]
            _time.sleep(0.002)
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(cpu_attention, "gemv", slow(real_gemv))
    assert loader.keep_plain_for_kernels(m, EngineSettings(), None, reps=3) is None
    assert m.plain_linear_ms["kernel"] > m.plain_linear_ms["oneDNN"]
    monkeypatch.setattr(cpu_attention, "gemv", real_gemv)
    monkeypatch.setattr(M, "_mm", slow(real_mm))
    why = loader.keep_plain_for_kernels(m, EngineSettings(), None, reps=3, decode_threads=1)
    assert why is not None and why.startswith("kept plain for the CPU kernels' whole-layer decode step: a row by "
                                              "2 layers' linears took")
    assert why.endswith("in oneDNN's packed call (1 threads, as a one-session torch step decodes)")
    # kept: a later start takes the verdict measured here (it is part of the cache identity), whatever it would
    # measure now
    cache = str(tmp_path)
    first = loader.keep_plain_for_kernels(m, EngineSettings(), cache, reps=3)
    assert first is not None and first.startswith("kept plain")
    monkeypatch.setattr(M, "_mm", real_mm)
    monkeypatch.setattr(cpu_attention, "gemv", slow(slow(real_gemv)))
    assert loader.keep_plain_for_kernels(m, EngineSettings(), cache, reps=3) == \
        first + " (measured at an earlier start here)"
    monkeypatch.setattr(cpu_attention, "load", lambda cache_dir: {"loaded": False, "reason": "no C compiler on PATH"})
    assert loader.keep_plain_for_kernels(m, EngineSettings(), None) is None
    with pytest.raises(errors.Fatal, match="MODELD_CPU_KERNELS=on, but no C compiler on PATH"):
        loader.keep_plain_for_kernels(m, EngineSettings(cpu_kernels="on"), None)
