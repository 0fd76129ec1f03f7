"""Serving profiles end to end on the real SmolLM2-135M (fp32 weights): int8 / fp8-e4m3 KV and block-sparse prefill.

Quality is measured against the dense fp32-KV session engine with ``modeld_cell.quality`` (thresholds live there,
in PROFILE_THRESHOLDS; docs/kernels.md "Profiles in the worker" quotes them with measured values).
"""

from __future__ import annotations

import json

import pytest
import torch

from modeld_cell import errors, quality
from modeld_cell.engine import EngineSettings

from .cellutil import LOGIT_ATOL, generate

pytestmark = pytest.mark.cell

QUANT = ["int8", "fp8-e4m3"]
SPARSE_PROFILE = {"weights": "fp32", "kv": "fp32", "attention": "block-sparse", "prefixReuse": True}


@pytest.mark.parametrize("kv", QUANT)
def test_quantized_capacity(make_engine, kv):
    """Bytes/token include the fp32 scales (docs/kernels.md table); the same budget holds ~1.88x bf16's tokens."""
    q, bf16 = make_engine(kv_mib=64, kv=kv), make_engine(kv_mib=64, kv="bf16")
    cq, cb = q.capability()["kv"], bf16.capability()["kv"]
    assert cq["precision"] == kv and cq["storage"] == {"int8": "int8", "fp8-e4m3": "float8_e4m3fn"}[kv]
    assert (cq["bytes_per_token"], cb["bytes_per_token"]) == (12_240, 23_040)
    assert cq["max_tokens_in_budget"] == (64 << 20) // (12_240 * 16) * 16 == 5472
    assert cq["max_tokens_in_budget"] / cb["max_tokens_in_budget"] >= 1.85   # 5472 / 2912 = 1.879
    assert q.kv.k.dtype == {"int8": torch.int8, "fp8-e4m3": torch.float8_e4m3fn}[kv]
    assert q.kv.k_scale is not None and q.kv.k_scale.dtype == torch.float32


@pytest.mark.parametrize("kv", QUANT)
async def test_quantized_budget_is_real(make_engine, kv):
    """A session fills exactly max_tokens_in_budget tokens of a 4 MiB budget; one more is Overflow."""
    e = make_engine(kv_mib=4, kv=kv)
    n = e.capability()["kv"]["max_tokens_in_budget"]
    assert n == 336                                         # 21 blocks of 16 x 12,240 B in 4 MiB (bf16: 176)
    toks = (e.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 40)[:n]
    tr = await e.ensure_prefix("full", toks)
    assert tr.tokens_computed == n and tr.kv_bytes == 21 * 16 * 12_240
    with pytest.raises(errors.Overflow):
        await e.prefill_suffix("full", toks[:1])


@pytest.mark.parametrize("kv", QUANT)
async def test_quantized_quality_smoke(engine, make_engine, kv):
    r = await quality.quality_smoke(make_engine(kv=kv), engine)
    print(kv, json.dumps(r))
    assert quality.check(kv, r) == [], r


@pytest.mark.parametrize("kv", QUANT)
async def test_quantized_prefix_sharing_and_snapshot(make_engine, tmp_path, kv):
    e = make_engine(kv=kv)
    base = e.tokenizer.encode("Once upon a time, in a quiet village by the sea, there lived an old fisherman. " * 2)
    await e.ensure_prefix("a", base + e.tokenizer.encode(" He sailed"))
    tr = await e.ensure_prefix("b", base + e.tokenizer.encode(" She sang"))
    assert tr.reuse["source"] == "prefix-cache" and tr.tokens_reused >= 32
    assert e.kv.ref[e._sessions["a"].blocks[0]] == 2                    # shared, quantized blocks
    want_ids, _, _ = await generate(e, "a", 6)
    path = str(tmp_path / "a.snap")
    await e.snapshot("b", path)
    logits_b = e.next_token_logits("b")
    await e.restore("c", path)
    assert torch.equal(e.next_token_logits("c"), logits_b)
    ids_b, _, _ = await generate(e, "b", 6)
    ids_c, _, _ = await generate(e, "c", 6)
    assert ids_b == ids_c and len(want_ids) == 6
    other = make_engine(kv=[k for k in QUANT if k != kv][0])
    with pytest.raises(errors.BadRequest, match="kv_dtype"):
        await other.restore("x", path)


async def test_block_sparse_short_prompt_reports_dense_fallback(make_engine):
    e = make_engine(profile=SPARSE_PROFILE)
    assert e.capability()["attention"]["mode"] == "block-sparse"
    tr = await e.ensure_prefix("s", e.tokenizer.encode("The capital of France is"))
    fb = tr.fallback
    assert fb["requested"] == "block-sparse" and fb["ran"] == "dense"
    assert "shorter than 4096" in fb["reason"], fb
    ids, text, _ = await generate(e, "s", 6)
    assert "Paris" in text
    tr = await e.prefill_suffix("s", e.tokenizer.encode(" Also,"))
    assert tr.fallback["ran"] == "dense" and "cached tokens" in tr.fallback["reason"]


async def test_block_sparse_forced_matches_dense(engine, make_engine):
    """MODELD_SPARSE_MIN_TOKENS lowered (and no density cut-off): a 287-token prompt runs block-sparse in every layer
    with blocks really skipped, and stays within the block-sparse thresholds of the dense engine."""
    st = EngineSettings(threads=torch.get_num_threads(), sparse_min_tokens=64, sparse_max_density=1.0)
    e = make_engine(profile=SPARSE_PROFILE, settings=st)
    tr = await e.ensure_prefix("p", e.tokenizer.encode(quality.LONG_PROMPTS[0]))
    assert tr.fallback is None, tr.fallback
    last = e.capability()["attention"]["sparse"]["last_chunk"]
    assert last["sparse_layers"] == last["layers"] == 30
    density = sum(last["densities"]) / len(last["densities"])
    assert density < 0.9                                     # blocks really were skipped
    e.close_session("p")
    r = await quality.quality_smoke(e, engine, prompts=quality.LONG_PROMPTS, n_tokens=24, passkey_repeats=14)
    print("block-sparse", f"density {density:.3f}", json.dumps(r))
    assert quality.check("block-sparse", r) == [], r


async def test_block_sparse_full_mask_is_exact(engine, make_engine):
    """keep ratio 1.0 keeps every causal block: the sparse path must reproduce dense logits (fp32 tolerance)."""
    st = EngineSettings(threads=torch.get_num_threads(), sparse_min_tokens=64, sparse_max_density=1.0,
                        sparse_keep_ratio=1.0)
    e = make_engine(profile=SPARSE_PROFILE, settings=st)
    ids = e.tokenizer.encode(quality.LONG_PROMPTS[0])
    assert (await e.ensure_prefix("x", ids)).fallback is None
    engine.clear_prefix_cache()
    await engine.ensure_prefix("x-dense", ids)
    torch.testing.assert_close(e.next_token_logits("x"), engine.next_token_logits("x-dense"), atol=LOGIT_ATOL, rtol=0)
    engine.close_session("x-dense")
