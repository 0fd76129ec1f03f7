"""LoRA adapters (spec.model.adapter) on the real SmolLM2 (fp32): merged weights against an independent reference,
logits, a refusal at load, and the cache identity. What needs no model (the scale, the fp32 merge on a tiny model,
file references, every refused adapter) is in tests/unit/test_lora.py.

Adapters are random PEFT-format files for SmolLM2's shapes, written by tests/unit/test_lora.py's helpers. Engine
loads: the shared base engine plus three (B = 0, nonzero, a missing path).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from modeld_cell import errors
from modeld_cell.engine import CellConfig, Engine, EngineSettings
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.models import lora
from modeld_cell.models.fetch import file_sha256
from tests.unit.test_lora import ALPHA, LAYOUT, ROWS, R, random_pairs, write_adapter

from .cellutil import full_logits
from .conftest import SPEC

pytestmark = pytest.mark.cell


def adapter_spec(ref: str, kv_mib: int = 16) -> dict:
    return {**SPEC, "kvMemoryMiB": kv_mib, "model": {**SPEC["model"], "adapter": ref}}


@pytest.fixture(scope="module")
def adapted(tmp_path_factory, smollm2_path):
    """Two engines on ONE adapter path: first with B = 0 (PEFT's init), then the file rewritten with a nonzero B."""
    d = tmp_path_factory.mktemp("adapter") / "lora"
    pairs = random_pairs(seed=0)
    write_adapter(d, random_pairs(seed=0, zero_b=True))
    zero = Engine.from_cell(adapter_spec(str(d)), model_path=smollm2_path)
    write_adapter(d, pairs)
    live = Engine.from_cell(adapter_spec(str(d)), model_path=smollm2_path)
    yield SimpleNamespace(dir=d, pairs=pairs, zero=zero, live=live)
    zero.shutdown()
    live.shutdown()


def test_merged_weights_are_base_plus_scaled_delta(engine, adapted):
    base, merged = engine.model.state_dict(), adapted.live.model.state_dict()
    scale = ALPHA / R
    touched = set()
    for (layer, m), (a, b) in adapted.pairs.items():
        name, rows, _ = ROWS[m]
        key = f"layers.{layer}.{name}.weight"
        touched.add(key)
        want = base[key][rows].double() + scale * (b.double() @ a.double())
        torch.testing.assert_close(merged[key][rows].double(), want, atol=1e-6, rtol=1e-6)
        assert merged[key].dtype == torch.float32
    # every other row of a touched fused weight, and every other weight, is bitwise the base
    assert torch.equal(merged["layers.0.attention.wqkv.weight"][ROWS["k_proj"][1]],
                       base["layers.0.attention.wqkv.weight"][ROWS["k_proj"][1]])
    for name, rows in (("attention.wqkv", ROWS["q_proj"][1]), ("attention.wqkv", ROWS["v_proj"][1]),
                       ("feed_forward.w13", ROWS["gate_proj"][1])):
        key = f"layers.29.{name}.weight"
        assert torch.equal(merged[key][rows], base[key][rows]), (key, rows)
    for key in base.keys() - touched:
        assert torch.equal(merged[key], base[key]), key


def test_zero_b_is_the_base_model_and_a_nonzero_b_is_not(engine, adapted):
    toks = engine.tokenizer.encode("The lighthouse keeper counted the ships every night.")
    base = full_logits(engine, toks)
    assert torch.equal(full_logits(adapted.zero, toks), base)       # W + 0 == W exactly
    diff = (full_logits(adapted.live, toks) - base).abs().max().item()
    assert diff > 0.05, diff


def test_from_cell_refuses_a_missing_adapter(smollm2_path, tmp_path):
    with pytest.raises(errors.BadRequest, match="does not exist") as ei:
        Engine.from_cell(adapter_spec(str(tmp_path / "missing")), model_path=smollm2_path)
    assert ei.value.details["field"] == "model.adapter"


def _twin(eng: Engine, cache: PagedKVCache) -> Engine:
    cfg = CellConfig.from_spec({**SPEC, "kvMemoryMiB": 16})
    return Engine(eng.model, eng.tokenizer, cache, cfg, dict(eng.identity),
                  EngineSettings(threads=torch.get_num_threads()))


async def test_adapters_never_share_prefix_blocks(engine, adapted):
    base_key, zero_key, live_key = engine.reuse_key(), adapted.zero.reuse_key(), adapted.live.reuse_key()
    assert len({engine._root, adapted.zero._root, adapted.live._root}) == 3
    # one path, two files: only the adapter's content tells them apart
    assert {k for k in zero_key if zero_key[k] != live_key[k]} == {"adapter"}
    assert zero_key["adapter"]["ref"] == live_key["adapter"]["ref"] == str(adapted.dir)
    assert base_key["adapter"] is None and base_key["model_digest"] == live_key["model_digest"]
    # engines over ONE KV pool: base blocks are found by another base engine, never by an adapter engine
    a = engine.model.args
    cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format("fp32"), 8 << 20)
    engines = [_twin(e, cache) for e in (engine, engine, adapted.zero, adapted.live)]
    try:
        p = engine.tokenizer.encode("One winter a ship without a name came into the harbour. " * 6)[:48]
        await engines[0].ensure_prefix("s", p)
        engines[0].close_session("s")
        assert (await engines[1].ensure_prefix("s", p)).tokens_reused == 47     # control: the same identity hits
        engines[1].close_session("s")
        for e in engines[2:]:
            assert (await e.ensure_prefix("s", p)).tokens_reused == 0
            e.close_session("s")
        assert (await engines[3].ensure_prefix("t", p)).tokens_reused == 47     # its own blocks, though
    finally:
        for e in engines:
            e.shutdown()


def test_capability_reports_the_adapter(engine, adapted):
    assert engine.capability()["model"]["adapter"] is None
    cap = adapted.live.capability()["model"]
    ad = cap["adapter"]
    assert ad["sha256"] == file_sha256(adapted.dir / lora.WEIGHTS_FILE) != adapted.zero.identity["adapter"]["sha256"]
    assert (ad["ref"], ad["rank"], ad["alpha"], ad["scale"]) == (str(adapted.dir), R, ALPHA, ALPHA / R)
    assert ad["targets"] == sorted(ROWS) and ad["layers"] == sorted(LAYOUT)
    assert cap["digest"] == engine.capability()["model"]["digest"]       # model digest: the base weights
    json.dumps(adapted.live.capability())
