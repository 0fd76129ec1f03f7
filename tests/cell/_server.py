"""Helpers for the server tests: an HTTP client over the real engine, typed-error checks, an SSE reader.

Every server test runs on the session's event loop: the engine is shared by the whole run and its decode loop lives on
the loop that first used it. Test modules import the fixtures (``client_fixture`` is the fixture ``client``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from modeld_cell import schemas
from modeld_cell.server import create_app
from modeld_cell.settings import Settings

WAIT_S = 120.0  # upper bound for a state to settle; a safety net against hangs, never a measured timing


def new_sid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def open_client(engine: Any, cache_dir: str, **settings: Any) -> TestClient:
    app = create_app(Settings(cache_dir=cache_dir, **settings), engine=engine, model_name="SmolLM2-135M-Instruct")
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def call(client: TestClient, method: str, path: str, body: Any = None, *, raw: str | bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    if raw is not None:
        resp = await client.request(method, path, data=raw, headers=headers)
    elif body is not None:
        resp = await client.request(method, path, json=body, headers=headers)
    else:
        resp = await client.request(method, path, headers=headers)
    async with resp:
        text = await resp.text()
    return resp.status, (json.loads(text) if resp.content_type == "application/json" else text)


def assert_error(status: int, body: Any, http: int, kind: str, field: str | None = None) -> dict[str, Any]:
    """The typed error body, with the kind's status and (when given) the offending field named."""
    assert status == http, (status, body)
    schemas.ErrorResponse.model_validate(body)
    err = body["error"]
    assert err["kind"] == kind, body
    assert err["message"], body
    if field is not None:
        assert err["details"].get("field") == field, body
    return err


async def session(client: TestClient, sid: str) -> dict[str, Any]:
    """The session's entry and tokens (GET /v1/sessions/{id})."""
    status, body = await call(client, "GET", f"/v1/sessions/{sid}")
    assert status == 200, body
    schemas.SessionInfoResponse.model_validate(body)
    return body


async def wait_idle(client: TestClient, sid: str) -> dict[str, Any]:
    """Polls until no request runs on the session (e.g. after a client went away mid-stream)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while True:
        info = await session(client, sid)
        if info["session"]["busy"] is None:
            return info
        assert loop.time() < end, f"session {sid} still busy after {WAIT_S}s: {info['session']}"
        await asyncio.sleep(0.02)


async def tokenize(client: TestClient, **body: Any) -> list[int]:
    status, out = await call(client, "POST", "/v1/tokenize", body)
    assert status == 200, out
    return out["tokens"]


async def sse_events(resp: ClientResponse) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Parses text/event-stream as it arrives: yields (event, data) per blank-line-terminated event."""
    event: str | None = None
    data: list[str] = []
    while True:
        line = await resp.content.readline()
        if not line:
            return
        text = line.decode().rstrip("\r\n")
        if text.startswith("event:"):
            event = text[6:].strip()
        elif text.startswith("data:"):
            data.append(text[5:].strip())
        elif text == "" and event is not None:
            yield event, json.loads("\n".join(data))
            event, data = None, []


@pytest_asyncio.fixture(loop_scope="session", name="client")
async def client_fixture(engine: Any, tmp_path: Any) -> AsyncIterator[TestClient]:
    """An HTTP client on a fresh app over the shared real engine; snapshots go under this test's tmp_path."""
    c = await open_client(engine, str(tmp_path))
    yield c
    await c.close()


@pytest_asyncio.fixture(loop_scope="session", name="sid")
async def sid_fixture(client: TestClient) -> AsyncIterator[str]:
    """A session id of this test's own; the session is closed afterwards so the shared KV budget is not used up."""
    name = new_sid()
    yield name
    await call(client, "DELETE", f"/v1/sessions/{name}")
