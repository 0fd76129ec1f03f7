"""The HTTP API's happy paths on the real engine and model: turns, accounting, snapshots, tokenizer, metrics."""

from __future__ import annotations

import pytest

from modeld_cell import openapi, schemas
from modeld_cell.metrics import NAMES

from ._server import call, client_fixture, session, sid_fixture, tokenize  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cell, pytest.mark.asyncio(loop_scope="session")]


async def test_health_and_readiness(client):
    assert await call(client, "GET", "/healthz") == (200, {"status": "ok"})
    status, ready = await call(client, "GET", "/readyz")
    assert status == 200 and ready["ready"] is True and len(ready["instance"]) == 32


async def test_capability_and_tokenizer_round_trip(client):
    status, cap = await call(client, "GET", "/v1/capability")
    assert status == 200
    assert cap["context_tier"] > 0 and cap["model"]["vocab_size"] == 49152

    text = "Hello, world: 12 tokens or so."
    ids = await tokenize(client, text=text)
    status, out = await call(client, "POST", "/v1/detokenize", {"tokens": ids})
    assert status == 200 and out == {"text": text}

    status, out = await call(client, "POST", "/v1/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                                             "add_generation_prompt": True})
    assert status == 200 and out["count"] == len(out["tokens"])
    status, rendered = await call(client, "POST", "/v1/detokenize", {"tokens": out["tokens"]})
    assert rendered["text"].startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert rendered["text"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


async def test_multi_turn_token_accounting_adds_up(client, sid):
    """Every request's trace agrees with the session, and the session's totals are the sum of its requests."""
    base = f"/v1/sessions/{sid}"
    p = await tokenize(client, messages=[{"role": "system", "content": "You count."}])
    turns = [await tokenize(client, text=f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
             for q in ("Count to three.", "Again, to five.")]
    traces = []

    status, out = await call(client, "POST", base + "/prefix", {"tokens": p})
    assert status == 200, out
    t = schemas.SessionResponse.model_validate(out).trace
    # a new session may share the head of another live session's KV (cross-session prefix reuse)
    assert (t.prompt_tokens, t.tokens_reused + t.tokens_computed, t.session_tokens) == (len(p), len(p), len(p))
    assert t.tokens_computed >= 1
    traces.append(t)
    history = list(p)

    for suffix in turns:
        status, out = await call(client, "POST", base + "/suffix", {"tokens": suffix})
        assert status == 200, out
        t = schemas.SessionResponse.model_validate(out).trace
        assert t.prompt_tokens == len(suffix) and t.tokens_reused == 0
        # After a decode the last generated token has no KV yet: it runs with the suffix.
        assert t.tokens_computed in (len(suffix), len(suffix) + 1)
        history += suffix
        assert t.session_tokens == len(history)
        traces.append(t)

        status, out = await call(client, "POST", base + "/decode", {"max_tokens": 6})
        assert status == 200, out
        d = schemas.DecodeResponse.model_validate(out)
        assert 1 <= d.trace.completion_tokens <= 6 and len(d.tokens) == d.trace.completion_tokens
        assert d.finish_reason in ("stop", "length")
        history += d.tokens
        assert d.trace.session_tokens == len(history)
        traces.append(d.trace)

    assert (await session(client, sid))["tokens"] == history
    totals = traces[-1].totals
    for field in ("prompt_tokens", "completion_tokens", "tokens_reused", "tokens_computed"):
        assert getattr(totals, field) == sum(getattr(t, field) for t in traces), field
    assert totals.prompt_tokens + totals.completion_tokens == len(history)

    # EnsurePrefix with the whole history reuses it; with an earlier point it keeps exactly that prefix.
    status, out = await call(client, "POST", base + "/prefix", {"tokens": history})
    t = schemas.SessionResponse.model_validate(out).trace
    assert t.tokens_reused + t.tokens_computed == len(history) and t.tokens_computed <= 1
    cut = len(p) + len(turns[0])
    status, out = await call(client, "POST", base + "/prefix", {"tokens": history[:cut]})
    t = schemas.SessionResponse.model_validate(out).trace
    assert (t.tokens_reused, t.tokens_computed, t.session_tokens) == (cut, 0, cut)
    assert (await session(client, sid))["tokens"] == history[:cut]


async def test_chat_messages_turn_answers(client, sid):
    base = f"/v1/sessions/{sid}"
    status, out = await call(client, "POST", base + "/prefix",
                             {"messages": [{"role": "system", "content": "Answer in one short sentence."}]})
    assert status == 200, out
    status, out = await call(client, "POST", base + "/suffix",
                             {"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, out
    status, out = await call(client, "POST", base + "/decode", {"max_tokens": 12})
    assert status == 200, out
    assert "Paris" in out["text"]
    # The suffix rendered as a continuation: one system prompt, ours, and the assistant header before the answer.
    status, text = await call(client, "POST", "/v1/detokenize", {"tokens": (await session(client, sid))["tokens"]})
    assert text["text"].count("<|im_start|>system") == 1
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" in text["text"]


async def test_snapshot_restore_round_trip(client, sid):
    base = f"/v1/sessions/{sid}"
    await call(client, "POST", base + "/prefix", {"text": "The capital of France is"})
    status, snap = await call(client, "POST", base + "/snapshot", {"path": "turn1/s.snap"})
    assert status == 200, snap
    schemas.SnapshotResponse.model_validate(snap)
    held = (await session(client, sid))["tokens"]

    await call(client, "POST", base + "/suffix", {"text": " a city"})
    status, out = await call(client, "POST", base + "/restore", {"path": "turn1/s.snap"})
    assert status == 200, out
    assert out["trace"]["session_tokens"] == len(held)
    assert (await session(client, sid))["tokens"] == held

    other = sid + "-copy"
    status, out = await call(client, "POST", f"/v1/sessions/{other}/restore", {"path": "turn1/s.snap"})
    assert status == 200, out
    try:
        a = await call(client, "POST", base + "/decode", {"max_tokens": 3})
        b = await call(client, "POST", f"/v1/sessions/{other}/decode", {"max_tokens": 3})
        assert a[0] == b[0] == 200
        assert a[1]["tokens"] == b[1]["tokens"] and "Paris" in a[1]["text"]
    finally:
        await call(client, "DELETE", f"/v1/sessions/{other}")


async def test_sessions_list_and_close(client):
    name = "list-me.1"
    await call(client, "POST", f"/v1/sessions/{name}/prefix", {"text": "hello"})
    status, out = await call(client, "GET", "/v1/sessions")
    assert status == 200
    assert name in [s["session_id"] for s in schemas.SessionsResponse.model_validate(out).sessions]
    assert await call(client, "DELETE", f"/v1/sessions/{name}") == (200, {"session_id": name, "closed": True})
    status, out = await call(client, "GET", "/v1/sessions")
    assert name not in [s["session_id"] for s in out["sessions"]]


async def test_metrics_exports_the_names(client, sid):
    await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": "one two three"})
    await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": "one two three four"})
    await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 2})
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    for name in NAMES:
        assert f"modeld:{name}" in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("modeld:") and not line.startswith("modeld:cache_config_info")}
    assert values["modeld:prompt_tokens_total"] >= 7
    assert values["modeld:prefix_cache_hits_total"] >= 3  # the second prefix reused the first's tokens
    assert values["modeld:generation_tokens_total"] >= 1
    assert 'modeld:cache_config_info{block_size="16"' in text


async def test_openapi_served_is_the_generated_document(client):
    """The committed document with the model's bounds as numbers (token ids below its vocabulary size)."""
    status, doc = await call(client, "GET", "/openapi.json")
    assert status == 200 and doc == openapi.build(vocab_size=49152)
    assert doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 49151


async def test_cache_salt_scopes_a_new_session_over_http(client, sid):
    """cache_salt reaches the engine: another scope sees no reuse of this session's prompt, the same scope does, and
    a session asked under another salt (or an empty one) is refused naming the field."""
    text = "A private note for one tenant only: the build server's password rotates every Monday at nine. " * 3
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": text, "cache_salt": "tenant-a"})
    assert status == 200, out
    results = {}
    for salt in ("tenant-b", "tenant-a"):
        other = f"{sid}-{salt}"
        status, out = await call(client, "POST", f"/v1/sessions/{other}/prefix", {"text": text, "cache_salt": salt})
        assert status == 200, out
        results[salt] = out["trace"]["tokens_reused"]
        await call(client, "DELETE", f"/v1/sessions/{other}")
    assert results["tenant-b"] == 0 and results["tenant-a"] > 0, results
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": text, "cache_salt": "tenant-b"})
    # the request is valid; the session's scope refuses it (409, like a request already running on it)
    assert status == 409 and out["error"]["kind"] == "conflict", out
    assert out["error"]["details"]["field"] == "cache_salt", out
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": text, "cache_salt": ""})
    assert status == 400 and "cache_salt" in str(out), out
