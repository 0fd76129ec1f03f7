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

from .cellutil import generate
from .conftest import SPEC
from .test_invariance import assert_like_cold, prompt, siblings_of

pytestmark = pytest.mark.cell

DTYPE = "bf16" if autotune.bf16_computes() else "fp32"
KERNEL = {"int8": Int8WeightOnlyLinear, "q4_1": Int4WeightOnlyLinear}


@pytest.fixture(scope="module", params=["int8", "q4_1"])
def quant(request, smollm2_path: str) -> Engine:
    fmt = request.param
    spec = {**SPEC, "profile": {**SPEC["profile"], "weights": fmt, "kv": DTYPE}}
    settings = EngineSettings(threads=torch.get_num_threads(), weights_path=f"{fmt}-{DTYPE}")
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
