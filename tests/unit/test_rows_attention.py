"""cpu.c's row attention as a CPU cell's prefill attention (#18): runner.choose_row_attention's settings, its
measured choice at the test's own prices, and what serving it means for the model's bits. Where it serves, a
prefill cut anywhere, the eager exact decode step and the scripted exact step all give a token the same K/V and
logits bit for bit (exact reuse rests on that), a quantized pool keeps the segmented calls, and the start-up probe
checks the row attention rather than the calls it replaced. A tiny random model with head dim 32 (the row attention
takes multiples of 32). Mechanisms only: which attention is faster on this CPU is measured at start, never asserted."""

from __future__ import annotations

import time

import pytest
import torch

from modeld_cell import decode_step as DS
from modeld_cell import errors
from modeld_cell import model as M
from modeld_cell.kernels.paged_decode import cpu
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.runner import TorchRunner, choose_row_attention

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(M._FLASH_CPU is None, reason="this torch has no CPU flash attention with LSE")]


def _model(dtype: torch.dtype = torch.float32, head_dim: int = 32) -> M.Transformer:
    args = M.ModelArgs(vocab_size=96, dim=96, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=head_dim,
                       intermediate_size=128, max_seq_len=1024, tie_embeddings=True)
    torch.manual_seed(0)
    return M.Transformer(args).eval().to(dtype)


def _runner(m: M.Transformer, kv_fmt: str = "fp32") -> TorchRunner:
    a = m.args
    return TorchRunner(m, PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(kv_fmt), 1 << 23, 16))


@pytest.fixture
def rows_kernel() -> None:
    if cpu._compiler() is None:
        pytest.skip("no C compiler on PATH: the worker keeps the segmented flash calls")
    rep = cpu.load(None)
    assert rep["loaded"], rep["reason"]
    if rep["rows_isa"] is None:
        pytest.skip("this build has no row attention loop (no AVX2 + FMA)")


def test_the_settings_and_what_refuses_it(rows_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model()
    rep = choose_row_attention(m, "segmented", "auto", torch.float32, 1, None)
    assert m.row_attention is None and rep == {"served": "segmented", "setting": "segmented",
                                               "reason": "MODELD_PREFILL_ATTENTION=segmented"}
    assert choose_row_attention(m, "auto", "off", torch.float32, 1, None)["reason"] == "MODELD_CPU_KERNELS=off"
    rep = choose_row_attention(m, "rows", "auto", torch.float32, 1, None)
    assert m.row_attention == cpu.ROWS_NAME and rep["reason"] == "MODELD_PREFILL_ATTENTION=rows"
    assert "median_ms" not in rep and m.row_attention_report is rep
    assert _runner(m).rows_attention == cpu.ROWS_NAME
    assert _runner(m, "bf16").rows_attention == cpu.ROWS_NAME
    assert _runner(m, "int8").rows_attention is None          # a quantized pool: the segmented calls
    with pytest.raises(errors.Fatal, match="MODELD_PREFILL_ATTENTION=rows, but MODELD_CPU_KERNELS=off"):
        choose_row_attention(m, "rows", "off", torch.float32, 1, None)
    narrow = _model(head_dim=16)
    rep = choose_row_attention(narrow, "auto", "auto", torch.float32, 1, None)
    assert narrow.row_attention is None and "multiple of 32" in rep["reason"]
    with pytest.raises(errors.Fatal, match="multiple of 32"):
        choose_row_attention(narrow, "rows", "auto", torch.float32, 1, None)
    for setting in ("auto", "rows"):       # a pool it does not read keeps the segmented calls, never a refusal
        rep = choose_row_attention(m, setting, "auto", torch.float16, 1, None)
        assert m.row_attention is None and rep["served"] == "segmented"
        assert rep["reason"] == "the row attention reads a bf16/fp32 KV cache, not torch.float16"
    monkeypatch.setattr(cpu, "load", lambda cache_dir: {"loaded": False, "reason": "no C compiler on PATH"})
    assert choose_row_attention(m, "auto", "auto", torch.float32, 1, None)["reason"] == "no C compiler on PATH"


@pytest.mark.parametrize(("rows_ms", "segmented_ms", "served"), [(2.0, 6.0, cpu.ROWS_NAME), (6.0, 2.0, None)])
def test_auto_serves_the_faster_at_the_tests_prices(rows_kernel, monkeypatch: pytest.MonkeyPatch, rows_ms: float,
                                                     segmented_ms: float, served: str | None) -> None:
    def priced(ms: float):  # type: ignore[no-untyped-def]
        def run(*a, **k) -> None:  # type: ignore[no-untyped-def]   # the test's price only, no CPU's
            time.sleep(ms / 1e3)
        return run

    monkeypatch.setattr(cpu, "rows_attention", priced(rows_ms))
    monkeypatch.setattr(M, "_segmented_attention", priced(segmented_ms))
    m = _model()
    rep = choose_row_attention(m, "auto", "auto", torch.bfloat16, 2, None, reps=3)
    assert m.row_attention == served and set(rep["median_ms"]) == {"rows", "segmented"}
    assert (rep["median_ms"]["rows"] < rep["median_ms"]["segmented"]) == (served is not None)
    assert rep["rows"] == 512 and rep["past"] == 1024 - 512 and rep["threads"] == 2 and rep["reps"] == 3
    assert rep["reason"].startswith("one layer's attention" if served else "the segmented flash calls took")


def test_a_later_start_takes_the_verdict_kept_in_the_cache(rows_kernel, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path) -> None:
    """The choice is part of the cache identity: measured once per machine, threads, dtypes, heads and cpu.c and
    kept, so a restart whose own timing would go the other way (here: the prices swapped) serves what it served."""
    def priced(name: str):  # type: ignore[no-untyped-def]
        def run(*a, **k) -> None:  # type: ignore[no-untyped-def]   # the test's price only, no CPU's
            time.sleep(price[name] / 1e3)
        return run

    price = {"rows": 2.0, "segmented": 6.0}
    monkeypatch.setattr(cpu, "rows_attention", priced("rows"))
    monkeypatch.setattr(M, "_segmented_attention", priced("segmented"))
    first = choose_row_attention(_model(), "auto", "auto", torch.float32, 1, str(tmp_path), reps=3)
    assert first["served"] == cpu.ROWS_NAME and first["cached"] is False
    assert len(list((tmp_path / "autotune").glob("prefill-attention-*.json"))) == 1
    price.update(rows=6.0, segmented=2.0)
    m = _model()
    again = choose_row_attention(m, "auto", "auto", torch.float32, 1, str(tmp_path), reps=3)
    assert again["cached"] is True and again["median_ms"] == first["median_ms"] and m.row_attention == cpu.ROWS_NAME
    other = choose_row_attention(_model(), "auto", "auto", torch.float32, 2, str(tmp_path), reps=3)
    assert other["cached"] is False and other["served"] == "segmented"      # another thread count: measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_where_it_serves_a_token_has_one_set_of_bits(rows_kernel, dtype: torch.dtype) -> None:
    """One prefill of 300 tokens; the same tokens in chunks cut across 64-key blocks; and the last three decoded
    one at a time, eagerly and by the scripted exact step: every layer's K/V and the logits equal bit for bit."""
    m = _model(dtype)
    if M.can_pack(dtype):             # as the loader serves dense weights (plain fp32 rows are not row-invariant here)
        M.pack_linears(m)
    choose_row_attention(m, "rows", "auto", dtype, 2, None)
    probe = M.probe_chunking_invariance(m)                   # it checks the row attention it serves
    if probe is not None:
        assert not probe.startswith("attention ("), probe
        pytest.skip(f"this CPU's linears are not row-invariant here: {probe}")
    kv_fmt = "bf16" if dtype == torch.bfloat16 else "fp32"
    r = _runner(m, kv_fmt)
    assert "cpu.c rows" in r.kernels()["prefill"]
    toks = [(i * 31 + 7) % m.args.vocab_size for i in range(300)]
    n = r.kv.blocks_for(300)
    one, cut, stepped, scripted = (r.kv.allocate(n) for _ in range(4))
    cut, scripted = cut[::-1], scripted[1:] + scripted[:1]     # scattered tables too
    want, _, _ = r.prefill(toks, 0, one)
    start = 0
    for end in (1, 63, 64, 65, 130, 299, 300):
        got, _, _ = r.prefill(toks[start:end], start, cut)
        start = end
    assert torch.equal(got, want)
    r.prefill(toks[:297], 0, stepped)
    r.prefill(toks[:297], 0, scripted)
    step = DS.ScriptedDecode(m, r.kv, kernel=True)
    for pos in (297, 298, 299):
        eager = r.decode([toks[pos]], [pos], [stepped])
        assert torch.equal(step(toks[pos], pos, scripted), eager)
    assert torch.equal(eager[0], want)                        # the last token decoded: a prefill's logits
    for c in (r.kv.k, r.kv.v):
        ref = c[:, one].reshape(c.shape[0], -1, *c.shape[3:])[:, :300]
        for blocks in (cut, stepped, scripted):
            assert torch.equal(c[:, blocks].reshape(c.shape[0], -1, *c.shape[3:])[:, :300], ref)


def test_the_runner_scripts_the_exact_step_through_it(rows_kernel) -> None:
    m = _model()
    choose_row_attention(m, "rows", "auto", torch.float32, 1, None)
    r = _runner(m)
    rep = r.choose_decode_step("script", reps=2, context=100)
    assert r.decode_step is not None and r.decode_step.kernel and rep["bitwise_equal"] is True


class _ByThreads(M.RowLinear):
    """A row linear whose rows round by torch's intra-op thread count (as a BLAS splitting its sums by thread would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (torch.get_num_threads() - 1) * 1e-3


def test_the_probe_finds_linears_that_round_by_thread_count():
    """linears_row_invariant compares each linear at one thread with the process's count: a decode step run at one
    thread must write the K/V a prefill at every thread computes."""
    lin, plain, g = _ByThreads(32, 16), M.RowLinear(32, 16), torch.Generator().manual_seed(0)
    if not (lin.pack() and plain.pack()):      # packed, as a CPU cell serves its linears: rows invariant by count
        pytest.skip(f"oneDNN cannot pack fp32 weights here: {M.pack_refused(torch.float32)}")
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        why = M.linears_row_invariant((("ffn", lin),), torch.float32, g, rows=64)
        assert why is not None and "at one thread differ from the same rows at 2 threads" in why, why
        torch.set_num_threads(1)                      # nothing to compare at one thread
        assert M.linears_row_invariant((("ffn", lin),), torch.float32, g, rows=64) is None
        assert M.linears_row_invariant((("plain", plain),), torch.float32, g, rows=64) is None
    finally:
        torch.set_num_threads(n)
    assert torch.get_num_threads() == n
