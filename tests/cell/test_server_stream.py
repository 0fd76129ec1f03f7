"""Server-sent events on the real engine: parsing, concurrent calls on a busy session, a client that goes away."""

from __future__ import annotations

import pytest

from modeld_cell import errors, schemas

from ._server import (  # noqa: F401  (fixtures)
    assert_error,
    call,
    client_fixture,
    new_sid,
    open_client,
    session,
    sid_fixture,
    sse_events,
    wait_idle,
)

pytestmark = [pytest.mark.cell, pytest.mark.asyncio(loop_scope="session")]

# Greedy SmolLM2 keeps counting here rather than stopping, so a decode runs for its whole max_tokens.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"


async def _stream(client, sid, **body):
    resp = await client.post(f"/v1/sessions/{sid}/decode", json={"stream": True, **body})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return resp


async def test_stream_matches_the_single_json_answer(client, sid):
    """The same greedy continuation arrives as token events plus done, or as one JSON; both leave equal sessions."""
    twin = sid + "-twin"
    try:
        for name in (sid, twin):
            status, _ = await call(client, "POST", f"/v1/sessions/{name}/prefix", {"text": "The capital of France is"})
            assert status == 200
        resp = await _stream(client, sid, max_tokens=8)
        events = [ev async for ev in sse_events(resp)]
        names = [e for e, _ in events]
        assert names[-1] == "done" and set(names[:-1]) <= {"token"} and len(names) >= 2
        tokens = [schemas.TokenEvent.model_validate(d) for e, d in events if e == "token"]
        done = schemas.DoneEvent.model_validate(events[-1][1])

        status, single = await call(client, "POST", f"/v1/sessions/{twin}/decode", {"max_tokens": 8})
        assert status == 200
        assert "".join(t.text for t in tokens) + done.text == single["text"]
        assert [t.id for t in tokens] == single["tokens"][: len(tokens)]
        assert done.finish_reason == single["finish_reason"]
        assert done.trace.completion_tokens == single["trace"]["completion_tokens"]
        assert (await session(client, sid))["tokens"] == (await session(client, twin))["tokens"]
    finally:
        await call(client, "DELETE", f"/v1/sessions/{twin}")


async def test_a_busy_session_answers_409_and_finishes_consistently(client, sid):
    await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": COUNTING})
    before = len((await session(client, sid))["tokens"])
    resp = await _stream(client, sid, max_tokens=48)
    events = sse_events(resp)
    event, _ = await anext(events)
    assert event == "token"  # the decode runs: the session is busy until its done event

    base = f"/v1/sessions/{sid}"
    for method, path, body in (("POST", "/suffix", {"text": " 9"}), ("POST", "/decode", {"max_tokens": 1}),
                               ("POST", "/decode", {"max_tokens": 1, "stream": True}),
                               ("POST", "/prefix", {"text": "other"}), ("POST", "/snapshot", {"path": "busy.snap"}),
                               ("DELETE", "", None)):
        status, out = await call(client, method, base + path, body)
        err = assert_error(status, out, 409, "conflict")
        assert err["details"]["running"] == "decode"

    rest = [ev async for ev in events]
    assert rest[-1][0] == "done"
    done = schemas.DoneEvent.model_validate(rest[-1][1])
    info = await session(client, sid)
    assert len(info["tokens"]) == before + done.trace.completion_tokens == done.trace.session_tokens
    status, out = await call(client, "POST", base + "/suffix", {"text": " and so on."})
    assert status == 200, out


async def test_client_gone_mid_stream_stops_decoding_and_keeps_the_session_usable(client, sid):
    prompt = (await call(client, "POST", "/v1/tokenize", {"text": COUNTING}))[1]["tokens"]
    await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"tokens": prompt})
    resp = await _stream(client, sid, max_tokens=200)
    events = sse_events(resp)
    streamed = [(await anext(events))[1]["id"] for _ in range(2)]
    resp.close()  # drop the connection with the decode still running

    info = await wait_idle(client, sid)
    held = info["tokens"]
    gained = held[len(prompt):]
    assert held[: len(prompt)] == prompt
    assert gained[:2] == streamed
    assert 2 <= len(gained) < 200  # the server stopped the decode when its write failed

    # What the session holds is exactly the greedy continuation a fresh session computes, and it continues alike.
    ref = new_sid("ref")
    try:
        await call(client, "POST", f"/v1/sessions/{ref}/prefix", {"tokens": prompt})
        status, out = await call(client, "POST", f"/v1/sessions/{ref}/decode", {"max_tokens": len(gained)})
        assert status == 200 and out["tokens"] == gained
        a = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 3})
        b = await call(client, "POST", f"/v1/sessions/{ref}/decode", {"max_tokens": 3})
        assert a[0] == b[0] == 200 and a[1]["tokens"] == b[1]["tokens"]
    finally:
        await call(client, "DELETE", f"/v1/sessions/{ref}")


class _FailsMidStream:
    """The real engine, except that decode ends after its first token with ``error`` (as a deadline or a backend
    failure would), so the server's mid-stream error path runs deterministically."""

    def __init__(self, inner, error):
        self._inner, self._error = inner, error

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def decode(self, *args, **kwargs):
        events = self._inner.decode(*args, **kwargs)

        async def gen():
            try:
                yield await anext(events)
            finally:
                await events.aclose()  # the engine's own stop: the session keeps the token, consistently
            raise self._error

        return gen()


@pytest.mark.parametrize(("error", "kind", "ready_after"), [
    (errors.Timeout("deadline passed after 1 generated tokens", partial_output="x"), "timeout", True),
    (RuntimeError("backend on fire"), "fatal", False),
], ids=["contract-error", "unexpected-exception"])
async def test_an_error_mid_stream_is_an_error_event(engine, tmp_path, error, kind, ready_after):
    c = await open_client(_FailsMidStream(engine, error), str(tmp_path))
    name = new_sid("midstream")
    try:
        await call(c, "POST", f"/v1/sessions/{name}/prefix", {"text": COUNTING})
        before = len((await session(c, name))["tokens"])
        resp = await _stream(c, name, max_tokens=20)
        events = [ev async for ev in sse_events(resp)]
        assert [e for e, _ in events] == ["token", "error"]
        assert_error(200, events[1][1], 200, kind)  # the status was sent with the first token; the body is typed
        status, _ = await call(c, "GET", "/readyz")
        assert (status == 200) is ready_after
        # A fatal worker answers nothing more, so look at the (healthy) engine underneath: it kept the one token.
        entry = next(x for x in engine.sessions() if x["session_id"] == name)
        assert entry["busy"] is None and entry["tokens"] == before + 1
    finally:
        engine.close_session(name)
        await c.close()
