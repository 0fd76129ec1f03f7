"""Chunking invariance on the real SmolLM2 in bf16: prefix reuse is bitwise exact, not merely close.

A position's K/V and next-token logits must be the same bits however the sequence got into the cache: one prefill
chunk, chunks cut anywhere (after a reused prefix), blocks shared from another session, or tokens decoded one at a
time in an earlier turn; and a session's output must not depend on which other sessions decode in the same batch.
model._segmented_attention (or cpu.c's row attention, kernels/paged_decode/cpu.py rows_attention) and model.RowLinear
are built for this (docs/reuse.md, "Exactness"). Whether this CPU's kernels keep it is measured when the engine
starts (model.probe_chunking_invariance): the engine claims "bitwise" only when the probe passes. These tests hold the
engine to its claim: bit for bit and the same greedy tokens where it says bitwise; within TOLERANCE_ATOL where it says
tolerance (an AMX Xeon's bf16 GEMMs round 16-32-row calls differently from 512-row ones), with the greedy tokens then
printed, not asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from modeld_cell import errors
from modeld_cell.engine import Engine, EngineSettings

from .cellutil import generate
from .conftest import SPEC, engine_factory, rows_or_segmented

pytestmark = pytest.mark.cell

TEXT = ("def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n"
        "The harbour master wrote every ship's name in a blue book, and the tide tables beside them. ")


@pytest.fixture(scope="module")
def bf16(smollm2_path: str) -> Engine:
    """The bf16 cell, prefilling through the attention the cell tier pins (conftest.rows_or_segmented): cpu.c's row
    attention where this machine has it. Its int8 KV siblings attend through the segmented flash calls (the row
    attention reads unquantized pools only), so both paths are held to bitwise reuse here."""
    spec = {**SPEC, "profile": {**SPEC["profile"], "weights": "bf16", "kv": "bf16"}}
    settings = dataclasses.replace(EngineSettings.from_env(), prefill_attention=rows_or_segmented())
    try:
        eng = Engine.from_cell(spec, model_path=smollm2_path, settings=settings)
    except errors.Unsupported as e:       # a CPU whose torch kernels have no bf16 path (ATEN_CPU_CAPABILITY=avx2)
        assert e.details["field"] == "profile.weights", e.details
        pytest.skip(f"the engine refuses bf16 weights on this CPU: {e}")
    assert eng.identity.get("prefill_attention") == (eng.model.row_attention if rows_or_segmented() == "rows"
                                                     else None)
    yield eng
    eng.shutdown()


def siblings_of(base: Engine, kv_default: str):
    """A fixture body: sib(chunk, kv, prefix_reuse) makes engines over ``base``'s weights with their own KV pool,
    prefill chunk size and KV format; they are shut down when the fixture ends."""
    made: list[Engine] = []
    make = engine_factory(base, base.config.raw, made)

    def sib(chunk: int = 512, kv: str = kv_default, prefix_reuse: bool = True) -> Engine:
        return make(kv=kv, settings=EngineSettings(threads=torch.get_num_threads(), prefill_chunk=chunk),
                    profile={"prefixReuse": prefix_reuse})

    yield sib
    for e in made:
        e.shutdown()


@pytest.fixture
def sibling(bf16: Engine):
    """Engines over the bf16 weights with their own KV pool, prefill chunk size and KV format."""
    yield from siblings_of(bf16, "bf16")


def prompt(eng: Engine, n: int) -> list[int]:
    ids = eng.tokenizer.encode(TEXT * 40)[:n]
    assert len(ids) == n
    return ids


def logits(eng: Engine, sid: str) -> torch.Tensor:
    out = eng.next_token_logits(sid)
    assert out is not None
    return out.clone()


async def cold(make, toks: list[int], n_new: int) -> tuple[torch.Tensor, list[int]]:
    """A fresh engine (no reuse possible), one-pass-ish prefill in 512-token chunks: the reference."""
    eng = make(512, prefix_reuse=False)
    await eng.ensure_prefix("cold", toks)
    lg = logits(eng, "cold")
    out, _, _ = await generate(eng, "cold", n_new, stop_token_ids=[])
    return lg, out


# bf16 logits of SmolLM2 reach ~40, where one ulp is 0.25; a few ulps of drift through 30 layers (0.5 measured on
# an AMX Xeon whose small-M GEMMs round differently) stay well inside 2.0. Only used where the engine claims tolerance.
TOLERANCE_ATOL = 2.0


def claims_bitwise(eng: Engine) -> bool:
    """The engine's claim (GET /v1/capability -> reuse), which must follow from its probe."""
    rep = eng.reuse_report()
    exact = rep["exactness"] == "bitwise"
    assert exact == rep["exactness_probe"].startswith("passed"), rep
    if not exact:
        print("reuse exactness here:", rep["exactness"], "-", rep["exactness_probe"])
    return exact


def assert_same(eng: Engine, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = float((got - want).abs().max())
    if claims_bitwise(eng):
        assert torch.equal(got, want), f"logits differ (max abs {diff:.3g}): reuse is not exact"
    else:
        assert diff <= TOLERANCE_ATOL, f"logits differ by {diff:.3g} > {TOLERANCE_ATOL}"


def assert_same_tokens(eng: Engine, got: list[int], want: list[int], what: object) -> None:
    if claims_bitwise(eng):
        assert got == want, what
    else:
        print(what, "greedy tokens equal:", got == want)


async def assert_like_cold(make, eng: Engine, sid: str, toks: list[int], n_new: int) -> None:
    """The session (holding toks, however it got them) has a cold run's logits, bit for bit, and greedy tokens."""
    want_lg, want = await cold(make, toks, n_new)
    assert_same(eng, logits(eng, sid), want_lg)
    got, _, _ = await generate(eng, sid, n_new, stop_token_ids=[])
    assert_same_tokens(eng, got, want, sid)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
async def test_any_chunking_gives_the_same_bits(sibling, kv):
    """Cuts at 1, 97, 300, 511/512/513 (segment edges), and a one-token chunk: the same logits, the same greedy text.
    A bf16 pool attends as the cell pins it (the row attention where the machine has it), an int8 one through the
    segmented flash calls."""
    n = 1100
    toks = prompt(sibling(), n)
    ref = sibling(512, kv=kv)
    assert ref.runner.rows_attention == (ref.model.row_attention if kv == "bf16" else None)
    claims_bitwise(ref)                                          # what GET /v1/capability -> reuse says
    await ref.ensure_prefix("a", toks)
    want_lg = logits(ref, "a")
    want, _, _ = await generate(ref, "a", 12, stop_token_ids=[])
    for chunk, first in ((97, 1), (300, 513), (1024, 511), (4096, n - 1)):
        eng = sibling(chunk, kv=kv)
        await eng.ensure_prefix("b", toks[:first])         # then the rest in `chunk`-sized pieces after it
        await eng.ensure_prefix("b", toks)
        assert_same(eng, logits(eng, "b"), want_lg)
        got, _, _ = await generate(eng, "b", 12, stop_token_ids=[])
        assert_same_tokens(eng, got, want, (chunk, first))


async def test_cross_session_hit_and_branch_are_bitwise(sibling):
    make = sibling
    toks = prompt(make(), 900)
    eng = make(512)
    await eng.ensure_prefix("trunk", toks)
    await generate(eng, "trunk", 5, stop_token_ids=[])
    tr = await eng.ensure_prefix("copy", toks)                       # shares 56 blocks, copies the head of the 57th
    assert tr.reuse["source"] == "prefix-cache" and tr.tokens_reused == len(toks) - 1
    await assert_like_cold(make, eng, "copy", toks, 10)
    branch = toks[:611] + eng.tokenizer.encode(" Then the bells rang twice and the harbour emptied.")
    tr = await eng.ensure_prefix("branch", branch)
    assert tr.tokens_reused == 611
    await assert_like_cold(make, eng, "branch", branch, 10)


async def test_multi_turn_with_decoded_tokens_matches_a_cold_run(sibling):
    """Turn 2's prompt holds turn 1's reply, whose K/V the session computed one decode step at a time; a cold run
    prefills the same tokens in chunks. Same bits after an edit in the middle, too (reuse stops at the edit)."""
    make = sibling
    eng = make(512)
    toks = prompt(eng, 700)
    await eng.ensure_prefix("s", toks)
    reply, _, _ = await generate(eng, "s", 20, stop_token_ids=[])
    turn2 = toks + reply + eng.tokenizer.encode("\nNow rewrite parse() to ignore comments.")
    tr = await eng.ensure_prefix("s", turn2)
    assert tr.tokens_reused >= len(toks) + len(reply) - 1
    await assert_like_cold(make, eng, "s", turn2, 16)
    edited = list(turn2)
    edited[350] = eng.tokenizer.encode(" lantern")[0]
    tr = await eng.ensure_prefix("s", edited)
    assert tr.tokens_reused == 350
    await assert_like_cold(make, eng, "s", edited, 8)


async def test_batched_decode_equals_decoding_alone(sibling):
    """Two sessions decoding in one batch (M = 2 rows per matmul) produce what each produces alone (M = 1)."""
    eng = sibling(512)
    a, b = prompt(eng, 300), prompt(eng, 450)[150:]
    await eng.ensure_prefix("a", a)
    await eng.ensure_prefix("b", b)
    together = await asyncio.gather(generate(eng, "a", 16, stop_token_ids=[]),
                                    generate(eng, "b", 16, stop_token_ids=[]))
    m = eng.metrics()
    assert m["decode_batch_tokens_total"] > m["decode_steps_total"], "the two decodes never shared a batch"
    alone = sibling(512)
    for sid, toks, (want, _, _) in (("a", a, together[0]), ("b", b, together[1])):
        await alone.ensure_prefix(sid, toks)
        got, _, _ = await generate(alone, sid, 16, stop_token_ids=[])
        assert_same_tokens(alone, got, want, sid)
        for e in (eng, alone):          # run the pending last token, so both sessions have next-token logits
            await e.ensure_prefix(sid, e.session_tokens(sid))
        assert_same(alone, logits(alone, sid), logits(eng, sid))
