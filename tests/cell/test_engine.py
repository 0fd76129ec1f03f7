"""The engine contract on the real SmolLM2-135M-Instruct (fp32, context tier 2048). See conftest for tolerances."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from modeld_cell import errors
from modeld_cell.engine import SamplingParams

from .cellutil import CONTEXT_TIER, LOGIT_ATOL, full_logits, generate, greedy_reference

pytestmark = pytest.mark.cell


def _held(eng, sid):
    s = eng._sessions[sid]
    return list(s.tokens), s.kv_len, list(s.blocks), None if s.logits is None else s.logits.clone()


async def test_capital_of_france_greedy(engine):
    ids = engine.tokenizer.encode("The capital of France is")
    tr = await engine.ensure_prefix("paris", ids)
    assert tr.tokens_computed == len(ids) and tr.tokens_reused == 0
    toks, text, last = await generate(engine, "paris", 8)
    assert "Paris" in text, text
    assert last.finish_reason in ("length", "stop")
    engine.close_session("paris")


@pytest.mark.parametrize("n", [15, 16, 17, 33], ids=lambda n: f"T{n}")
async def test_page_boundaries_match_full_recompute(engine, n):
    text = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who told stories. " * 3
    prompt = engine.tokenizer.encode(text)[:n]
    assert len(prompt) == n
    sid = f"pb{n}"
    # incremental: a prefix, then the rest as a suffix (crosses the block boundary at 16 when n > 16)
    await engine.ensure_prefix(sid, prompt[: n - 2])
    await engine.prefill_suffix(sid, prompt[n - 2 :])
    ref = full_logits(engine, prompt)
    torch.testing.assert_close(engine._sessions[sid].logits, ref[-1], atol=LOGIT_ATOL, rtol=0)
    toks, _, _ = await generate(engine, sid, 6)
    assert toks == greedy_reference(engine, prompt, 6)
    # after decoding, the KV the session holds equals a one-pass recompute of everything it holds
    held = engine.session_tokens(sid)
    tr = await engine.prefill_suffix(sid, [])  # runs only the pending last generated token
    assert tr.tokens_computed == 1 and tr.session_tokens == len(held)
    assert (await engine.ensure_prefix(sid, held)).tokens_computed == 0
    torch.testing.assert_close(engine._sessions[sid].logits, full_logits(engine, held)[-1], atol=LOGIT_ATOL, rtol=0)
    engine.close_session(sid)


async def test_three_turn_session_matches_full_recompute(engine):
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Name a fruit."}]
    sid = "turns"
    for turn, follow in enumerate(["Name another one.", "And a vegetable?", None]):
        ids = tok.encode(tok.apply_chat_template(msgs))
        tr = await engine.ensure_prefix(sid, ids)
        if turn:
            assert tr.tokens_reused > 0 and tr.tokens_reused + tr.tokens_computed == len(ids)
        torch.testing.assert_close(engine._sessions[sid].logits, full_logits(engine, ids)[-1], atol=LOGIT_ATOL,
                                   rtol=0)
        got, text, _ = await generate(engine, sid, 12)
        assert got == greedy_reference(engine, ids, len(got))
        msgs.append({"role": "assistant", "content": tok.decode([t for t in got if t not in tok.eos_token_ids])})
        if follow:
            msgs.append({"role": "user", "content": follow})
    # totals add up over the session
    s = engine.sessions()
    tot = next(x for x in s if x["session_id"] == sid)["totals"]
    assert tot["tokens_reused"] + tot["tokens_computed"] == tot["prompt_tokens"]
    assert tot["completion_tokens"] > 0
    engine.close_session(sid)


async def test_edit_in_the_middle_reuses_up_to_first_change(engine):
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)[:45]
    await engine.ensure_prefix("edit", ids)
    edited = list(ids)
    edited[23] = (edited[23] + 1) % engine.vocab_size
    tr = await engine.ensure_prefix("edit", edited)
    assert tr.tokens_reused == 23 and tr.tokens_computed == len(ids) - 23
    assert engine.session_tokens("edit") == edited
    torch.testing.assert_close(engine._sessions["edit"].logits, full_logits(engine, edited)[-1],
                               atol=LOGIT_ATOL, rtol=0)
    # a shorter target that is a prefix: truncation only, nothing computed
    tr = await engine.ensure_prefix("edit", edited[:30])
    assert (tr.tokens_reused, tr.tokens_computed, tr.session_tokens) == (30, 0, 30)
    toks, _, _ = await generate(engine, "edit", 3)
    assert toks == greedy_reference(engine, edited[:30], 3)
    engine.close_session("edit")


async def test_context_overflow_refused_state_untouched(engine):
    ids = engine.tokenizer.encode("hello world " * 10)[:20]
    await engine.ensure_prefix("ovf", ids)
    before, free = _held(engine, "ovf"), engine.kv.free_blocks
    with pytest.raises(errors.Overflow):
        await engine.ensure_prefix("ovf", [5] * (CONTEXT_TIER + 1))
    with pytest.raises(errors.Overflow):
        await engine.prefill_suffix("ovf", [5] * (CONTEXT_TIER - len(ids) + 1))
    after = _held(engine, "ovf")
    assert after[:3] == before[:3] and torch.equal(after[3], before[3]) and engine.kv.free_blocks == free
    with pytest.raises(errors.Overflow):
        await engine.ensure_prefix("ovf-new", [5] * (CONTEXT_TIER + 1))
    assert "ovf-new" not in engine._sessions
    engine.close_session("ovf")


async def test_max_tokens_clamped_to_context_tier(make_engine, monkeypatch):
    """61 tokens in a 64-token tier: max_tokens 50 is clamped to 3, all 3 are generated, and then the tier is full.
    The engine always adds the tokenizer's EOS ids to the stop set; they are emptied here (the tokenizer object is
    the shared one, restored after the test) so that nothing but the clamp can end the decode."""
    eng = make_engine(kv_mib=8, contextTier=64)
    monkeypatch.setattr(eng.tokenizer, "eos_token_ids", [])
    ids = eng.tokenizer.encode("one two three four five six seven eight nine ten " * 8)[:61]
    await eng.ensure_prefix("c", ids)
    toks, _, last = await generate(eng, "c", 50, stop_token_ids=[])
    assert last.trace.clamped == {"field": "max_tokens", "requested": 50, "granted": 3, "reason": "context tier"}
    assert len(toks) == 3 and last.finish_reason == "length" and last.trace.session_tokens == 64
    assert toks == greedy_reference(eng, ids, 3)
    with pytest.raises(errors.Overflow) as ei:
        await generate(eng, "c", 5)
    assert {k: ei.value.details[k] for k in ("session_tokens", "context_tier", "reason")} == \
        {"session_tokens": 64, "context_tier": 64, "reason": "context tier"}


async def test_memory_exhaustion_overflow_others_intact(make_engine):
    eng = make_engine(kv_mib=4)                     # 4 MiB / (46080 B/token * 16) = 5 blocks = 80 tokens
    assert eng.kv.num_blocks == 5
    ids = eng.tokenizer.encode("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. " * 4)
    a, b = ids[:30], ids[5:35]                      # 2 blocks each
    await eng.ensure_prefix("a", a)
    await eng.ensure_prefix("b", b)
    snap = {sid: _held(eng, sid) for sid in ("a", "b")}
    with pytest.raises(errors.Overflow) as ei:
        await eng.ensure_prefix("c", ids[10:50])    # 3 blocks > 1 free
    assert ei.value.http_status == 413
    assert "c" not in eng._sessions
    for sid in ("a", "b"):
        now = _held(eng, sid)
        assert now[:3] == snap[sid][:3] and torch.equal(now[3], snap[sid][3])
    toks, _, last = await generate(eng, "a", 2)     # fits in the session's own last block
    assert toks == greedy_reference(eng, a, len(toks))
    assert eng.kv.free_blocks == 1
    # budget exhausted for decode: clamped to what is left, or Overflow when nothing is left
    await eng.ensure_prefix("c", ids[:16])          # takes the last free block
    _, _, last_b = await generate(eng, "b", 40)
    assert last_b.trace.clamped and last_b.trace.clamped["reason"] == "kv memory budget"


async def test_concurrent_calls_on_one_session_conflict(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon."}]))
    await engine.ensure_prefix("busy", ids)
    it = engine.decode("busy", SamplingParams(), 20)
    first = await it.__anext__()
    assert first.token_id is not None
    with pytest.raises(errors.Conflict):
        await engine.ensure_prefix("busy", ids)
    with pytest.raises(errors.Conflict):
        await engine.prefill_suffix("busy", [5])
    with pytest.raises(errors.Conflict):
        await engine.decode("busy", SamplingParams(), 5).__anext__()
    with pytest.raises(errors.Conflict):
        engine.close_session("busy")
    # a second, different session decodes concurrently (batched) without interference
    await engine.ensure_prefix("other", ids)
    other = asyncio.create_task(generate(engine, "other", 10))
    rest = [ev async for ev in it]
    assert rest[-1].done
    got_other, _, _ = await other
    assert got_other == greedy_reference(engine, ids, len(got_other))
    engine.close_session("busy")
    engine.close_session("other")


async def test_decode_cancellation_leaves_session_consistent(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count from one to fifty."}]))
    await engine.ensure_prefix("cancel", ids)
    it = engine.decode("cancel", SamplingParams(), 40)
    got = []
    async for ev in it:
        got.append(ev.token_id)
        if len(got) == 3:
            break
    await it.aclose()
    s = engine._sessions["cancel"]
    assert s.busy is None
    held = engine.session_tokens("cancel")
    assert held[: len(ids)] == ids and held[len(ids) : len(ids) + 3] == got
    assert s.kv_len in (len(held), len(held) - 1)
    assert len(s.blocks) == engine.kv.blocks_for(len(held))
    more, _, _ = await generate(engine, "cancel", 4)
    assert more == greedy_reference(engine, held, 4)
    engine.close_session("cancel")


async def test_snapshot_restore_into_second_engine(engine, make_engine, tmp_path):
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there!"}]))
    await engine.ensure_prefix("snap", ids)
    await generate(engine, "snap", 5)
    path = str(tmp_path / "s.snap")
    info = await engine.snapshot("snap", path)
    assert info["bytes"] == os.path.getsize(path) and info["session_tokens"] == len(engine.session_tokens("snap"))
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    other = make_engine(kv_mib=32)
    tr = await other.restore("r", path)
    assert tr.session_tokens == info["session_tokens"]
    assert tr.totals == engine.sessions()[[x["session_id"] for x in engine.sessions()].index("snap")]["totals"]
    a, _, _ = await generate(engine, "snap", 8)
    b, _, _ = await generate(other, "r", 8)
    assert a == b
    engine.close_session("snap")


async def test_snapshot_refusals_leave_target_untouched(engine, make_engine, tmp_path):
    ids = engine.tokenizer.encode("Snapshots must be checked before use.")
    await engine.ensure_prefix("src", ids)
    good = str(tmp_path / "good.snap")
    await engine.snapshot("src", good)
    data = open(good, "rb").read()
    other = make_engine(kv_mib=16)
    await other.ensure_prefix("t", ids[:5])
    before, free = _held(other, "t"), other.kv.free_blocks

    def check_untouched():
        now = _held(other, "t")
        assert now[:3] == before[:3] and other.kv.free_blocks == free

    corrupt = tmp_path / "corrupt.snap"
    corrupt.write_bytes(data[:200] + bytes([data[200] ^ 0xFF]) + data[201:])
    truncated = tmp_path / "trunc.snap"
    truncated.write_bytes(data[: len(data) // 2])
    junk = tmp_path / "junk.snap"
    junk.write_bytes(b"not a snapshot at all" * 10)
    for p, word in ((corrupt, "checksum"), (truncated, "checksum"), (junk, "magic")):
        with pytest.raises(errors.BadRequest, match=word):
            await other.restore("t", str(p))
        check_untouched()
    foreign = make_engine(kv_mib=16, identity={"model_digest": "sha256:" + "0" * 64})
    with pytest.raises(errors.BadRequest) as ei:
        await foreign.restore("t", good)
    assert set(ei.value.details["mismatch"]) == {"model_digest"}
    bf16 = make_engine(kv_mib=16, kv="bf16")
    with pytest.raises(errors.BadRequest) as ei:
        await bf16.restore("t", good)
    assert ei.value.details["mismatch"] == {"kv_dtype": {"snapshot": "fp32", "engine": "bf16"}}
    with pytest.raises(errors.NotFound):
        await other.restore("t", str(tmp_path / "missing.snap"))
    check_untouched()
    engine.close_session("src")


async def test_bad_requests(engine):
    v = engine.vocab_size
    for bad in ([-1], [v], ["a"], [1.5], [True], "text", None):
        with pytest.raises(errors.BadRequest):
            await engine.ensure_prefix("bad", bad)
    assert "bad" not in engine._sessions
    await engine.ensure_prefix("bad", [1, 2, 3])
    for p in (SamplingParams(temperature=-1), SamplingParams(temperature=11), SamplingParams(temperature=float("nan")),
              SamplingParams(top_p=0), SamplingParams(top_p=1.5), SamplingParams(top_k=-1),
              SamplingParams(top_k=v + 1), SamplingParams(seed=-3), SamplingParams(temperature="hot")):
        with pytest.raises(errors.BadRequest):
            engine.decode("bad", p, 4)
    for mt in (-1, 2.5, "10", None):
        with pytest.raises(errors.BadRequest):
            engine.decode("bad", SamplingParams(), mt)
    with pytest.raises(errors.BadRequest):
        engine.decode("bad", SamplingParams(), 4, stop_token_ids=[v])
    with pytest.raises(errors.BadRequest):
        engine.decode("bad", SamplingParams(), 4, stop=[""])
    with pytest.raises(errors.NotFound):
        await engine.prefill_suffix("nope", [1])
    with pytest.raises(errors.NotFound):
        engine.decode("nope", SamplingParams(), 4)
    assert engine.session_tokens("bad") == [1, 2, 3]
    engine.close_session("bad")


async def test_seeded_sampling_reproducible_and_stop_string(engine):
    ids = engine.tokenizer.encode("Here is a short poem about the sea:\n")
    await engine.ensure_prefix("samp", ids)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    a, _, _ = await generate(engine, "samp", 12, params=p)
    await engine.ensure_prefix("samp", ids)
    b, _, _ = await generate(engine, "samp", 12, params=p)
    assert a == b
    await engine.ensure_prefix("samp", engine.tokenizer.encode("The capital of France is"))
    toks, text, last = await generate(engine, "samp", 10, stop=["."])
    assert last.finish_reason == "stop" and "." not in text and "Paris" in text
    engine.close_session("samp")


async def test_deadline_timeout_reports_partial_output(engine, monkeypatch):
    import modeld_cell.scheduler as E  # the decode loop checks deadlines
    ids = engine.tokenizer.encode("List the planets of the solar system: Mercury,")
    await engine.ensure_prefix("dl", ids)
    # a deadline already passed: Timeout before any token, session untouched
    with pytest.raises(errors.Timeout) as ei:
        async for _ in engine.decode("dl", SamplingParams(), 50, deadline=time.monotonic() - 1):
            pass
    assert ei.value.details["partial_output"] == "" and engine.session_tokens("dl") == ids
    # a deadline that passes after 3 decode steps (clock patched: no timing assumptions)
    real, calls = E._deadline_passed, {"n": 0}

    def fake(deadline):
        if deadline is None:
            return False
        calls["n"] += 1
        return calls["n"] > 3

    monkeypatch.setattr(E, "_deadline_passed", fake)
    with pytest.raises(errors.Timeout) as ei:
        async for _ in engine.decode("dl", SamplingParams(), 50, stop_token_ids=[], deadline=1.0):
            pass
    monkeypatch.setattr(E, "_deadline_passed", real)
    d = ei.value.details
    assert d["completion_tokens"] == len(d["token_ids"]) == 3
    assert d["partial_output"] == engine.tokenizer.decode(d["token_ids"])
    assert engine.session_tokens("dl") == ids + d["token_ids"]
    assert engine._sessions["dl"].busy is None
    with pytest.raises(errors.Timeout):
        await engine.ensure_prefix("dl2", ids, deadline=time.monotonic() - 1)
    assert "dl2" not in engine._sessions
    more, _, _ = await generate(engine, "dl", 2)
    assert more == greedy_reference(engine, ids + d["token_ids"], 2)
    engine.close_session("dl")


async def test_fatal_backend_error_marks_not_ready(make_engine):
    eng = make_engine(kv_mib=8)
    await eng.ensure_prefix("f", [1, 2, 3])

    def boom(*a, **k):
        raise RuntimeError("simulated device failure")

    eng.runner.decode = boom                     # the backend's decode forward (runner.py) fails
    with pytest.raises(errors.Fatal):
        await generate(eng, "f", 3)
    assert eng.ready is False
    with pytest.raises(errors.Fatal):
        await eng.ensure_prefix("g", [1])


def test_capability_reports_exact_figures(engine):
    cap = engine.capability()
    assert cap["context_tier"] == CONTEXT_TIER
    assert cap["kv"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert cap["kv"]["max_tokens_in_budget"] == (256 << 20) // (2 * 30 * 3 * 64 * 4 * 16) * 16
    assert cap["kv"]["precision"] == "fp32"
    assert cap["model"]["digest"].startswith("sha256:") and cap["model"]["params"] == 134_515_008
    assert cap["runtime"]["threads"] >= 1 and cap["runtime"]["torch"] == torch.__version__
    assert cap["unsupported"] and cap["attention"]["mode"] == "dense"
    m = engine.metrics()
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"} <= set(m)
