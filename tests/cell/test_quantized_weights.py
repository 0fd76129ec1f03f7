"""Quantized weights served on the real SmolLM2 (issue #18): ``profile.weights`` int8 and q4_1 multiplied by torch's
weight-only CPU kernels (modeld_cell/quantize.py), their quality gate, and prefix reuse with them.

The paths are forced (EngineSettings.weights_path), so what runs is known whatever the measurement would choose here;
the bf16-activation path where this CPU's torch computes bf16, else fp32. No test asserts a measured quality verdict:
the gate is tested with thresholds the test sets (a lax one passes, an impossible one refuses naming the field),
and the measured numbers are printed (docs/cell-benchmarks.md has them per machine).
"""

from __future__ import annotations

import pytest
import torch

from modeld_cell import autotune, errors, profile_gate
from modeld_cell.engine import Engine, EngineSettings
from modeld_cell.loader import _dense_model
from modeld_cell.models import load_checkpoint
from modeld_cell.quantize import Int4WeightOnlyLinear, Int8WeightOnlyLinear, QuantEmbedding

from .cellutil import CONTEXT_TIER, generate
from .conftest import SPEC
from .test_invariance import assert_like_cold, prompt, siblings_of

pytestmark = pytest.mark.cell

DTYPE = "bf16" if autotune.bf16_computes() else "fp32"
KERNEL = {"int8": Int8WeightOnlyLinear, "q4_1": Int4WeightOnlyLinear}


@pytest.fixture(scope="module", params=["int8", "q4_1"])
def quant(request, smollm2_path: str) -> Engine:
    fmt = request.param
    spec = {**SPEC, "profile": {**SPEC["profile"], "weights": fmt, "kv": DTYPE}}
    # decoded K/V exact: the multi-turn tests count the decoded tokens a later turn reuses (test_decoded_kv.py)
    settings = EngineSettings(threads=torch.get_num_threads(), weights_path=f"{fmt}-{DTYPE}", decoded_kv="exact")
    eng = Engine.from_cell(spec, model_path=smollm2_path, settings=settings, gate=False)
    eng.fmt = fmt
    yield eng
    eng.shutdown()


@pytest.fixture
def sibling(quant: Engine):
    """Engines over the quantized weights (siblings keep the kernel) with their own KV pool and chunk size."""
    yield from siblings_of(quant, DTYPE)


def test_the_kernel_multiplies_the_weights(quant, engine):
    """Every layer's Linears are the format's modules, no fp32 weight is kept, the capability report and the cache
    identity name the kernel. A Q4_1 GGUF keeps its embedding table in Q8_0, so q4_1 serves the tied head by the
    int8 kernel (quantize.head_kernel)."""
    fmt, cls = quant.fmt, KERNEL[quant.fmt]
    for layer in quant.model.layers:
        for lin in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
            assert isinstance(lin, cls)
    assert not [n for n, p in quant.model.named_parameters() if p.dtype == torch.float32 and p.dim() == 2]
    assert isinstance(quant.model.output, Int8WeightOnlyLinear)
    assert isinstance(quant.model.tok_embeddings, QuantEmbedding)
    assert (quant.config.weights_head, quant.identity["weights_kernel"].endswith("; head int8")) == (
        (None, False) if fmt == "int8" else ("int8", True))
    rt = quant.capability()["runtime"]
    assert (rt["weights_kernel"], rt["weights_dtype"], rt["weights_requested"]) == (fmt, DTYPE, fmt)
    assert rt["weights_choice"]["reason"] == f"MODELD_WEIGHTS_PATH={fmt}-{DTYPE}"
    assert quant.identity["weights_kernel"].startswith(f"{fmt} v")
    assert quant.reuse_key() != engine.reuse_key()
    fp32_bytes = engine.capability()["memory"]["weights_bytes"]
    assert quant.capability()["memory"]["weights_bytes"] < fp32_bytes / 3
    assert quant.capability()["model"]["params"] == engine.capability()["model"]["params"]


async def test_multi_turn_with_quantized_weights_matches_a_cold_run(sibling):
    """Prefix reuse stays exact with quantized weights: turn 2 reuses turn 1's prompt and decoded reply, and its
    logits and greedy tokens are a cold run's (bit for bit where the engine's probe claims it)."""
    eng = sibling(512)
    toks = prompt(eng, 600)
    await eng.ensure_prefix("s", toks)
    reply, _, _ = await generate(eng, "s", 12, stop_token_ids=[])
    turn2 = toks + reply + eng.tokenizer.encode("\nNow rewrite parse() to ignore comments.")
    tr = await eng.ensure_prefix("s", turn2)
    assert tr.tokens_reused >= len(toks) + len(reply) - 1
    await assert_like_cold(sibling, eng, "s", turn2, 8)


def test_the_quality_gate_measures_against_the_fp32_checkpoint(quant, smollm2_path, tmp_path):
    """The smoke of a quantized kernel runs against the checkpoint's weights in fp32 and is cached; a threshold it
    meets serves it, one it cannot meet refuses it naming profile.weights and the measurement."""
    if quant.fmt != "int8":
        pytest.skip("one format is enough for the mechanism (the smoke is the same code)")
    ckpt = load_checkpoint(smollm2_path)
    quant.fp32_weights = lambda: _dense_model(ckpt, quant.config, torch.float32, None, None)[0]
    try:
        lax = {"greedy_agreement_min": 0.0, "kl_mean_max": 1e9, "kl_max_max": 1e9, "capital": False,
               "passkey": False}
        [v] = profile_gate.require(quant, str(tmp_path), thresholds={"weights-int8": lax})
        print("int8 weights quality smoke here:", v.summary())
        assert v.profile == "weights-int8" and v.passed and not v.cached
        assert v.result["positions"] > 0 and 0.0 <= v.result["greedy_agreement"] <= 1.0
        impossible = dict(lax, greedy_agreement_min=1.01)
        with pytest.raises(errors.Unsupported) as e:
            profile_gate.require(quant, str(tmp_path), thresholds={"weights-int8": impossible})
        assert e.value.details["field"] == "profile.weights" and e.value.details["value"] == "int8"
        assert "against the same checkpoint's weights in fp32" in e.value.message
        assert e.value.details["verdict"]["cached"]                # the measurement was not repeated
    finally:
        quant.fp32_weights = None


def test_a_q4_1_cell_whose_smoke_fails_with_the_int8_head_is_built_again_with_the_head_dense(smollm2_path, tmp_path,
                                                                                             monkeypatch):
    """loader.load_engine: the real smoke runs on the int8 head, fails a threshold no model meets, and the cell is
    built and smoked again with the head dense (MODELD_INT8_HEAD off) before the refusal stands (the path is forced,
    so there is no dense candidate to fall back to)."""
    from modeld_cell import quality
    seen: list[str] = []
    real = profile_gate.require

    def spy(eng, *a, **k):
        seen.append(eng.identity["weights_kernel"])
        return real(eng, *a, **k)
    monkeypatch.setattr(profile_gate, "require", spy)
    monkeypatch.setitem(quality.PROFILE_THRESHOLDS, "weights-q4_1",
                        {**quality.PROFILE_THRESHOLDS["weights-q4_1"], "greedy_agreement_min": 1.01})
    spec = {**SPEC, "profile": {**SPEC["profile"], "weights": "q4_1", "kv": DTYPE}}
    settings = EngineSettings(threads=torch.get_num_threads(), weights_path=f"q4_1-{DTYPE}")
    with pytest.raises(errors.Unsupported) as e:
        Engine.from_cell(spec, model_path=smollm2_path, settings=settings, quality_cache=str(tmp_path))
    assert e.value.details["field"] == "profile.weights"
    assert [s.removeprefix("q4_1 v").split("; ", 1)[1] for s in seen] == ["head int8", "dense: output"]


def test_a_path_ranked_first_at_the_served_decode_count_is_built_instead(smollm2_path, tmp_path, monkeypatch):
    """`auto` ranks the paths before the model is loaded, at the count an earlier start's step decoded at or the
    process count; the loaded step's count is measured after (runner.choose_decode_threads). Where the ranking at
    that count names another path, the start builds that one instead (once) and keeps the count, so the next start
    ranks at it and builds once. The figures and the step's count are the test's own (the measurement and the
    thread choice are replaced), the loads are real."""
    from modeld_cell import loader
    from modeld_cell.runner import TorchRunner

    turns = {"dense-fp32": {"2": 1000.0, "1": 1500.0}, "q4_1-fp32": {"2": 1100.0, "1": 1200.0}}
    monkeypatch.setattr(autotune, "bf16_computes", lambda: False)
    monkeypatch.setattr(autotune, "other_busy_cores", lambda *a: 0.0)
    monkeypatch.setattr(autotune, "measure", lambda args, k, d, **kw: {
        "name": f"{k}-{d}", "kernel": k, "dtype": d, "prefill_ms_per_token": 1.0, "decode_ms": 0.0,
        "turn_ms": turns[f"{k}-{d}"]["2"], "decode_ms_by_threads": {"2": 0.0, "1": 0.0},
        "turn_ms_by_threads": turns[f"{k}-{d}"]})

    def one_thread(self, setting, *a, **k):
        self.decode_threads = 1
        self.decode_threads_report = {"threads": 1, "process_threads": 2, "reason": "the test's"}
        return self.decode_threads_report
    monkeypatch.setattr(TorchRunner, "choose_decode_threads", one_thread)
    built: list[str] = []
    real_build = loader._build_engine

    def build(cls, cfg, *a, **k):
        eng = real_build(cls, cfg, *a, **k)
        built.append(f"{cfg.weights_kernel}-{cfg.weights}")
        return eng
    monkeypatch.setattr(loader, "_build_engine", build)
    spec = {**SPEC, "profile": {**SPEC["profile"], "weights": "q4_1", "kv": "fp32"}}
    settings = EngineSettings(threads=2, decode_step="eager", decoded_kv="exact")
    eng = Engine.from_cell(spec, model_path=smollm2_path, settings=settings, quality_cache=str(tmp_path), gate=False)
    try:
        assert built == ["dense-fp32", "q4_1-fp32"]
        ch = eng.capability()["runtime"]["weights_choice"]
        assert (ch["name"], ch["decode_threads"]) == ("q4_1-fp32", 1) and eng.config.weights_kernel == "q4_1"
        assert ch["first_choice"]["name"] == "dense-fp32" and ch["first_choice"]["served_decode_threads"] == 1
        assert "decoding at 1" in ch["reason"] and "dense-fp32 1500.0 ms" in ch["reason"]
        # one thread taken: the loaded (real) step is timed at longer contexts too, up to the tier's last position
        wide = eng.capability()["runtime"]["decode_threads"]["wide"]
        assert list(wide["median_ms"])[0] == str(CONTEXT_TIER - 1) and wide["bitwise_equal"] is True
        assert eng.runner.decode_wide_from == wide["from"] and wide["from"] in (None, *map(int, wide["median_ms"]))
    finally:
        eng.shutdown()
    built.clear()
    eng = Engine.from_cell(spec, model_path=smollm2_path, settings=settings, quality_cache=str(tmp_path), gate=False)
    try:
        assert built == ["q4_1-fp32"] and "first_choice" not in eng.capability()["runtime"]["weights_choice"]
    finally:
        eng.shutdown()
