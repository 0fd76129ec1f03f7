"""A deliberately tiny cell: KV memory runs out with a few sessions, max_tokens gets clamped, and its bf16 snapshots
are foreign to the shared fp32 cell. Nothing already held is lost along the way."""

from __future__ import annotations

import pytest
import pytest_asyncio

from ._server import assert_error, call, client_fixture, open_client, session  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cell, pytest.mark.asyncio(loop_scope="session")]



@pytest_asyncio.fixture(loop_scope="session")
async def tiny(make_engine, tmp_path):
    """The shared weights behind a 4 MiB bf16 KV pool (23,040 bytes per token: 11 blocks of 16 tokens) and a
    64-token context tier."""
    c = await open_client(make_engine(kv_mib=4, kv="bf16", contextTier=64), str(tmp_path))
    yield c
    await c.close()


async def test_memory_exhaustion_with_many_sessions(tiny):
    _, cap = await call(tiny, "GET", "/v1/capability")
    assert cap["kv"]["num_blocks"] == 11 and cap["context_tier"] == 64
    # Three sessions of 47 tokens take 3 blocks each, a fourth of 32 tokens the last 2.
    for i in range(3):
        status, out = await call(tiny, "POST", f"/v1/sessions/s{i}/prefix", {"tokens": [504 + i] * 47})
        assert status == 200, out
    status, out = await call(tiny, "POST", "/v1/sessions/s3/prefix", {"tokens": [600] * 32})
    assert status == 200, out
    held = {f"s{i}": (await session(tiny, f"s{i}"))["tokens"] for i in range(4)}

    status, out = await call(tiny, "POST", "/v1/sessions/s4/prefix", {"tokens": [700]})
    err = assert_error(status, out, 413, "overflow")
    assert err["details"]["free_blocks"] == 0
    status, out = await call(tiny, "POST", "/v1/sessions/s0/suffix", {"tokens": [504] * 2})
    assert_error(status, out, 413, "overflow")
    status, _ = await call(tiny, "GET", "/v1/sessions/s4")
    assert status == 404
    for name, tokens in held.items():
        assert (await session(tiny, name))["tokens"] == tokens

    # The one free slot in s0's last block is all a decode may use: the request is clamped, not refused.
    status, out = await call(tiny, "POST", "/v1/sessions/s0/decode", {"max_tokens": 10})
    assert status == 200, out
    assert out["trace"]["clamped"] == {"field": "max_tokens", "requested": 10, "granted": 1,
                                       "reason": "kv memory budget"}
    assert out["trace"]["completion_tokens"] == 1 and out["finish_reason"] in ("length", "stop")

    # Closing a session gives its blocks back; the refused session now fits.
    assert (await call(tiny, "DELETE", "/v1/sessions/s3"))[0] == 200
    status, out = await call(tiny, "POST", "/v1/sessions/s4/prefix", {"tokens": [700] * 20})
    assert status == 200, out
    for name in ("s1", "s2"):
        assert (await session(tiny, name))["tokens"] == held[name]


async def test_max_tokens_beyond_the_context_tier_is_clamped(tiny):
    status, out = await call(tiny, "POST", "/v1/sessions/c/prefix", {"text": "One, two, three, four," * 6})
    assert status == 200, out
    n = out["trace"]["session_tokens"]
    assert 40 < n < 64
    status, out = await call(tiny, "POST", "/v1/sessions/c/decode", {"max_tokens": 100})
    assert status == 200, out
    assert out["trace"]["clamped"] == {"field": "max_tokens", "requested": 100, "granted": 64 - n,
                                       "reason": "context tier"}
    assert out["trace"]["session_tokens"] <= 64
    status, out = await call(tiny, "POST", "/v1/sessions/c/suffix", {"tokens": [504] * (65 - out["trace"]["session_tokens"])})
    assert_error(status, out, 413, "overflow")


async def test_foreign_snapshot_is_refused(tiny, client, tmp_path):
    """A bf16-KV snapshot restored into the fp32 cell: refused by identity, the target session untouched."""
    status, out = await call(tiny, "POST", "/v1/sessions/f/prefix", {"text": "The capital of France is"})
    assert status == 200
    status, out = await call(tiny, "POST", "/v1/sessions/f/snapshot", {"path": "tiny.snap"})
    assert status == 200, out

    status, out = await call(client, "POST", "/v1/sessions/f-target/prefix", {"text": "Hello"})
    before = await session(client, "f-target")
    try:
        status, out = await call(client, "POST", "/v1/sessions/f-target/restore", {"path": "tiny.snap"})
        err = assert_error(status, out, 400, "bad_request")
        assert "foreign" in err["message"] and "kv_dtype" in err["details"]["mismatch"]
        assert await session(client, "f-target") == before
    finally:
        await call(client, "DELETE", "/v1/sessions/f-target")
