"""Bad input on the real engine: every case gets a clear typed error naming its field, and no session state is lost."""

from __future__ import annotations

import logging
import os

import pytest

from modeld_cell.server import create_app
from modeld_cell.settings import Settings

from ._server import assert_error, call, client_fixture, new_sid, session, sid_fixture  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cell, pytest.mark.asyncio(loop_scope="session")]

VOCAB = 49152
# (route, body or raw text, expected field). Each must be refused with 400 bad_request before the engine is touched.
BAD_BODIES = [
    ("prefix", "{not json", "body"),
    ("prefix", "[1, 2, 3]", "body"),
    ("prefix", '"text"', "body"),
    ("prefix", b"\xff\xfe{}", "body"),
    ("prefix", {}, "body"),
    ("prefix", {"tokens": [1], "text": "both"}, "body"),
    ("prefix", {"text": "x", "temperature": 0.5}, "temperature"),
    ("prefix", {"tokens": "1 2 3"}, "tokens"),
    ("prefix", {"tokens": [1, "2"]}, "tokens[1]"),
    ("prefix", {"tokens": [1, 2.5]}, "tokens[1]"),
    ("prefix", {"tokens": [1, True]}, "tokens[1]"),
    ("prefix", {"tokens": [-1]}, "tokens[0]"),
    ("prefix", {"tokens": [1, VOCAB]}, "tokens[1]"),
    ("prefix", {"tokens": [1, 10**30]}, "tokens[1]"),
    ("prefix", {"text": 42}, "text"),
    ("prefix", {"messages": []}, "messages"),
    ("prefix", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("prefix", {"messages": [{"role": "User!", "content": "x"}]}, "messages[0].role"),
    ("prefix", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ("prefix", {"text": "x", "add_generation_prompt": True}, "body"),
    ("prefix", {"text": "x", "timeout_s": 0}, "timeout_s"),
    ("prefix", '{"text": "x", "timeout_s": NaN}', "timeout_s"),
    ("decode", {"max_tokens": 0}, "max_tokens"),
    ("decode", {"max_tokens": -5}, "max_tokens"),
    ("decode", {"max_tokens": 10**12}, "max_tokens"),
    ("decode", {"max_tokens": "8"}, "max_tokens"),
    ("decode", {"temperature": -0.1}, "temperature"),
    ("decode", {"temperature": 1e9}, "temperature"),
    ("decode", '{"temperature": Infinity}', "temperature"),
    ("decode", {"top_p": 0}, "top_p"),
    ("decode", {"top_p": 1.5}, "top_p"),
    ("decode", {"top_k": -1}, "top_k"),
    ("decode", {"top_k": VOCAB + 1}, "top_k"),
    ("decode", {"seed": -1}, "seed"),
    ("decode", {"seed": 2**64}, "seed"),
    ("decode", {"stop": "\n"}, "stop"),
    ("decode", {"stop": [""]}, "stop[0]"),
    ("decode", {"stop": ["x"] * 17}, "stop"),
    ("decode", {"stop_token_ids": [VOCAB]}, "stop_token_ids[0]"),
    ("decode", {"stream": "yes"}, "stream"),
    ("decode", {"timeout_s": -1}, "timeout_s"),
    ("decode", {"max_token": 5}, "max_token"),
    ("snapshot", {}, "path"),
    ("snapshot", {"path": "../outside.snap"}, "path"),
    ("snapshot", {"path": "/etc/passwd"}, "path"),
    ("snapshot", {"path": "a/./b"}, "path"),
    ("snapshot", {"path": "a//b"}, "path"),
    ("restore", {"path": "a\x00b"}, "path"),
]


async def _prepared(client, sid):
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": "The capital of France is"})
    assert status == 200, out
    return await session(client, sid)


@pytest.mark.parametrize(("route", "body", "field"), BAD_BODIES,
                         ids=[f"{r}-{i}-{f}" for i, (r, _, f) in enumerate(BAD_BODIES)])
async def test_bad_body_is_a_typed_400_and_changes_nothing(client, sid, route, body, field):
    before = await _prepared(client, sid)
    path = f"/v1/sessions/{sid}/{route}"
    raw = body if isinstance(body, (str, bytes)) else None
    status, out = await call(client, "POST", path, None if raw is not None else body, raw=raw,
                             headers={"Content-Type": "application/json"})
    err = assert_error(status, out, 400, "bad_request", field=field)
    assert field in err["message"] or field == "body"
    assert await session(client, sid) == before


async def test_bad_session_id_and_timeout_header(client, sid):
    for bad in ("-lead", "a" * 129, "sp ace", "semi;colon", "trailing%0A"):  # %0A: the pattern is ECMA's, $ is the end
        status, out = await call(client, "POST", f"/v1/sessions/{bad}/prefix", {"text": "x"})
        assert_error(status, out, 400, "bad_request", field="session_id")
    for header in ("soon", "0", "-3", "nan", "inf", "1e9"):
        status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"text": "x"},
                                 headers={"X-Request-Timeout": header})
        assert_error(status, out, 400, "bad_request", field="X-Request-Timeout")
    status, _ = await call(client, "GET", f"/v1/sessions/{sid}")
    assert status == 404  # none of the refused requests created the session


async def test_every_form_and_edge_the_document_allows_is_served(client, sid):
    """Integral numbers in any JSON form are integers (JSON Schema's reading), and the ends of every documented range
    are served; a tiny temperature is greedy in effect (before, 1.8e-280 made softmax NaN and the worker fatal)."""
    base = f"/v1/sessions/{sid}"
    status, out = await call(client, "POST", base + "/prefix", raw='{"tokens": [504, 2.0, 1e1, 4.00]}',
                             headers={"Content-Type": "application/json"})
    assert status == 200, out
    assert (await session(client, sid))["tokens"] == [504, 2, 10, 4]
    status, out = await call(client, "POST", base + "/prefix", {"text": "The capital of France is", "tokens": None,
                                                                "messages": None, "add_generation_prompt": None})
    assert status == 200, out                           # null is absent, as the document says
    for body in ({"max_tokens": 1.0, "top_k": VOCAB, "seed": 2**63 - 1, "temperature": 1.8e-280},
                 {"max_tokens": 1, "temperature": 5e-324, "top_p": 5e-324, "top_k": 1.0},
                 {"max_tokens": 1, "temperature": 10, "top_p": 1, "stop_token_ids": [VOCAB - 1.0]}):
        status, out = await call(client, "POST", base + "/decode", body)
        assert status == 200 and out["trace"]["completion_tokens"] == 1, (body, out)
    status, _ = await call(client, "GET", "/readyz")
    assert status == 200


async def test_valid_requests_the_session_state_refuses_are_409(client, sid):
    """An empty session cannot be decoded from; a snapshot path blocked by what the snapshot directory holds is a
    conflict too, and leaves the worker ready (before, a file in the way of the path's folders raised out of the
    handler: 503 fatal, and the worker stayed not ready)."""
    base = f"/v1/sessions/{sid}"
    assert (await call(client, "POST", base + "/prefix", {"tokens": []}))[0] == 200
    status, out = await call(client, "POST", base + "/decode", {"max_tokens": 1})
    assert_error(status, out, 409, "conflict")
    await _prepared(client, sid)
    assert (await call(client, "POST", base + "/snapshot", {"path": "blocker"}))[0] == 200
    assert (await call(client, "POST", base + "/snapshot", {"path": "dir/s.snap"}))[0] == 200
    for path in ("blocker/s.snap", "dir"):         # a file where a folder must be; a folder where the file goes
        status, out = await call(client, "POST", base + "/snapshot", {"path": path})
        assert_error(status, out, 409, "conflict", field="path")
    status, out = await call(client, "POST", base + "/restore", {"path": "blocker/s.snap"})
    assert_error(status, out, 404, "not_found", field="path")
    status, _ = await call(client, "GET", "/readyz")
    assert status == 200


async def test_unknown_session(client):
    ghost = new_sid("ghost")
    for method, route, body in (("POST", "/suffix", {"text": "x"}), ("POST", "/decode", {"max_tokens": 1}),
                                ("POST", "/decode", {"max_tokens": 1, "stream": True}),
                                ("POST", "/snapshot", {"path": "g.snap"}), ("GET", "", None), ("DELETE", "", None)):
        status, out = await call(client, method, f"/v1/sessions/{ghost}{route}", body)
        assert_error(status, out, 404, "not_found")
        assert ghost in out["error"]["message"]
    status, out = await call(client, "POST", f"/v1/sessions/{ghost}/restore", {"path": "missing.snap"})
    assert_error(status, out, 404, "not_found", field="path")


async def test_unknown_route_and_method(client):
    status, out = await call(client, "GET", "/v2/nothing")
    assert_error(status, out, 404, "not_found")
    resp = await client.request("PUT", "/v1/sessions/abc/prefix", json={"text": "x"})
    async with resp:
        out = await resp.json()
    err = assert_error(resp.status, out, 405, "method_not_allowed")
    assert err["details"]["allowed"] == ["POST"] and resp.headers["Allow"] == "POST"
    status, out = await call(client, "POST", "/healthz", {})
    assert_error(status, out, 405, "method_not_allowed")


async def test_prompt_beyond_the_context_tier_leaves_state_untouched(client, sid):
    _, cap = await call(client, "GET", "/v1/capability")
    tier = cap["context_tier"]
    before = await _prepared(client, sid)
    held = len(before["tokens"])

    status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix", {"tokens": [504] * (tier + 1)})
    err = assert_error(status, out, 413, "overflow")
    assert err["details"]["context_tier"] == tier
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/suffix", {"tokens": [504] * (tier - held + 1)})
    assert_error(status, out, 413, "overflow")
    assert await session(client, sid) == before

    status, out = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 2})
    assert status == 200 and "Paris" in out["text"]


async def test_deadline_passed_reports_partial_output_and_keeps_the_session_consistent(client, sid):
    before = await _prepared(client, sid)
    # A deadline a microsecond away has passed before the first decode step: nothing is generated.
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 50, "timeout_s": 1e-6})
    err = assert_error(status, out, 504, "timeout")
    n = err["details"]["completion_tokens"]
    assert err["details"]["partial_output"] == "" and n == 0
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 50},
                             headers={"X-Request-Timeout": "0.000001"})
    assert_error(status, out, 504, "timeout")
    assert len((await session(client, sid))["tokens"]) == len(before["tokens"])
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 2})
    assert status == 200 and "Paris" in out["text"]


async def test_corrupt_and_truncated_snapshots_are_refused(client, sid, tmp_path):
    await _prepared(client, sid)
    status, snap = await call(client, "POST", f"/v1/sessions/{sid}/snapshot", {"path": "good.snap"})
    assert status == 200, snap
    before = await session(client, sid)
    snapdir = tmp_path / "snapshots"
    good = (snapdir / "good.snap").read_bytes()
    (snapdir / "junk.snap").write_bytes(os.urandom(4096))
    (snapdir / "truncated.snap").write_bytes(good[: len(good) // 2])
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    (snapdir / "flipped.snap").write_bytes(bytes(flipped))
    (snapdir / "empty.snap").write_bytes(b"")
    other = new_sid("fresh")
    for name in ("junk", "truncated", "flipped", "empty"):
        for target in (sid, other):
            status, out = await call(client, "POST", f"/v1/sessions/{target}/restore", {"path": f"{name}.snap"})
            err = assert_error(status, out, 400, "bad_request")
            # the refused file, resolved inside the snapshot directory, and nothing more (no format version: the
            # magic or the checksum is what fails)
            assert err["details"] == {"path": os.path.join(os.path.dirname(snap["path"]), f"{name}.snap")}, err
    assert await session(client, sid) == before
    status, _ = await call(client, "GET", f"/v1/sessions/{other}")
    assert status == 404  # a refused restore creates no session


async def test_unexpected_exception_is_fatal_and_unready(engine, tmp_path, caplog):
    """A bug (any non-contract exception) answers 503 fatal, is logged, and the worker stops claiming readiness."""

    class Broken:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def capability(self):
            raise RuntimeError("wires crossed")

    from aiohttp.test_utils import TestClient, TestServer

    app = create_app(Settings(cache_dir=str(tmp_path)), engine=Broken(engine))
    async with TestClient(TestServer(app)) as c:
        with caplog.at_level(logging.ERROR, logger="modeld_cell.server"):
            status, out = await call(c, "GET", "/v1/capability")
        assert_error(status, out, 503, "fatal")
        assert any("wires crossed" in (r.exc_text or "") or r.exc_info for r in caplog.records)
        status, out = await call(c, "GET", "/readyz")
        assert_error(status, out, 503, "fatal")
        assert await call(c, "GET", "/healthz") == (200, {"status": "ok"})
    assert engine.ready  # the shared engine itself is fine


async def test_not_ready_while_the_model_loads(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(create_app(Settings(cache_dir=str(tmp_path))))) as c:
        assert await call(c, "GET", "/healthz") == (200, {"status": "ok"})
        for method, path, body in (("GET", "/readyz", None), ("GET", "/v1/sessions", None),
                                   ("POST", "/v1/sessions/a/prefix", {"text": "x"}),
                                   ("POST", "/v1/tokenize", {"text": "x"})):
            status, out = await call(c, method, path, body)
            assert_error(status, out, 503, "not_ready")
        status, text = await call(c, "GET", "/metrics")
        assert status == 200 and "modeld:errors_total" in text
