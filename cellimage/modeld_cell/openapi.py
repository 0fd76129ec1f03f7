"""The worker's HTTP API as data: the route table the server registers, and the OpenAPI 3.1 document made from it.

The request/response models in ``schemas.py`` are the single source; ``openapi.json`` beside this file is generated
(``python -m modeld_cell.openapi --write``) and a test fails when the committed copy drifts. Nobody edits it by hand.
The committed document names the bounds that depend on the model (``x-maximum``); the one a worker serves at
/openapi.json states them as numbers for its model (``build(vocab_size=...)``, ``for_model``).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import __version__
from . import schemas as s
from .errors import HTTP_STATUS

COMMITTED = Path(__file__).with_name("openapi.json")
REF = "#/components/schemas/{model}"

_ENGINE = ("not_ready", "fatal")  # any route that reaches the engine
_SESSION = ("bad_request", "not_found", "conflict", "timeout") + _ENGINE


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    operation_id: str
    summary: str
    request: type[BaseModel] | None
    response: type[BaseModel] | None  # None: a body that is not a pydantic model (see content)
    errors: tuple[str, ...]
    content: str = "application/json"
    stream: bool = False  # also answers text/event-stream when the body says stream: true
    tag: str = "sessions"


SESSION = "/v1/sessions/{session_id}"
ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("POST", SESSION + "/prefix", "ensure_prefix",
             "EnsurePrefix: make the session's KV hold exactly this prompt, reusing the longest common prefix",
             s.PrefixRequest, s.SessionResponse, ("bad_request", "conflict", "overflow", "timeout") + _ENGINE),
    Endpoint("POST", SESSION + "/suffix", "prefill_suffix", "PrefillSuffix: append to the session's KV",
             s.SuffixRequest, s.SessionResponse, _SESSION + ("overflow",)),
    Endpoint("POST", SESSION + "/decode", "decode", "Generate from the session's end (JSON, or SSE with stream: true)",
             s.DecodeRequest, s.DecodeResponse, _SESSION + ("overflow",), stream=True),
    Endpoint("POST", SESSION + "/snapshot", "snapshot", "Write the session's state to a snapshot file",
             s.SnapshotRequest, s.SnapshotResponse, _SESSION + ("unsupported",)),
    Endpoint("POST", SESSION + "/restore", "restore",
             "Replace the session's state with a snapshot's; refuses corrupt or foreign snapshots, state untouched",
             s.RestoreRequest, s.SessionResponse, _SESSION + ("overflow", "unsupported")),
    Endpoint("GET", SESSION, "get_session", "The session's state: its entry and the token ids it holds", None,
             s.SessionInfoResponse, ("bad_request", "not_found") + _ENGINE),
    Endpoint("DELETE", SESSION, "close_session", "Close the session and free its KV",
             None, s.CloseResponse, ("bad_request", "not_found", "conflict") + _ENGINE),
    Endpoint("GET", "/v1/sessions", "list_sessions", "Live sessions", None, s.SessionsResponse, _ENGINE),
    Endpoint("GET", "/v1/capability", "capability",
             "Capability report: context tier, tokens that fit the KV budget, bytes/token, model identity, modes",
             None, None, _ENGINE, tag="model"),
    Endpoint("POST", "/v1/tokenize", "tokenize", "Text or chat messages to token ids", s.TokenizeRequest,
             s.TokenizeResponse, ("bad_request",) + _ENGINE, tag="model"),
    Endpoint("POST", "/v1/detokenize", "detokenize", "Token ids to text", s.DetokenizeRequest, s.DetokenizeResponse,
             ("bad_request",) + _ENGINE, tag="model"),
    Endpoint("GET", "/healthz", "healthz", "Liveness: the process serves HTTP", None, s.HealthResponse, (),
             tag="operations"),
    Endpoint("GET", "/readyz", "readyz", "Readiness: the engine is loaded and has had no fatal error", None,
             s.ReadyResponse, _ENGINE, tag="operations"),
    Endpoint("GET", "/metrics", "metrics", "Prometheus metrics (vLLM-compatible names, prefix modeld:)", None, None,
             (), content="text/plain", tag="operations"),
    Endpoint("GET", "/openapi.json", "openapi", "This document", None, None, (), tag="operations"),
)

_KIND_TEXT = {
    "bad_request": "malformed JSON, wrong type, unknown field, out-of-range value or token id",
    "not_found": "unknown session or snapshot",
    "conflict": "the session's state refuses it now: a request is already running on it, it was created under "
                "another cache_salt, it holds no tokens to decode from, or the snapshot path is in the way of (or "
                "blocked by) a file or folder there",
    "overflow": "context tier or KV memory exceeded; state untouched",
    "timeout": "deadline exceeded; partial output in details",
    "unsupported": "this cell cannot do it",
    "fatal": "the backend failed; the worker is no longer ready",
    "not_ready": "the model is still loading",
    "method_not_allowed": "the route exists with another method",
}

_SSE_TEXT = (
    "Server-sent events, in order: any number of `event: token` (data: TokenEvent), then exactly one of "
    "`event: done` (data: DoneEvent) or `event: error` (data: ErrorResponse, e.g. a timeout with the partial output "
    "in details). Closing the connection stops generation; the session keeps the tokens generated so far. The schema "
    "describes one event: its name and its data, a JSON text (contentSchema)."
)
_SSE_EVENTS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("token", s.TokenEvent), ("done", s.DoneEvent), ("error", s.ErrorResponse))
# x-maximum (schemas.BELOW_VOCAB, UP_TO_VOCAB) -> its offset from the model's vocabulary size
_VOCAB_OFFSET = {s.BELOW_VOCAB["x-maximum"]: -1, s.UP_TO_VOCAB["x-maximum"]: 0}

_MODELS: tuple[type[BaseModel], ...] = (
    s.PrefixRequest, s.SuffixRequest, s.DecodeRequest, s.SnapshotRequest, s.RestoreRequest, s.TokenizeRequest,
    s.DetokenizeRequest, s.SessionResponse, s.DecodeResponse, s.TokenEvent, s.DoneEvent, s.SnapshotResponse,
    s.CloseResponse, s.SessionInfoResponse, s.SessionsResponse, s.TokenizeResponse, s.DetokenizeResponse, s.HealthResponse,
    s.ReadyResponse, s.ErrorResponse,
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _operation(ep: Endpoint) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": ep.operation_id, "summary": ep.summary, "tags": [ep.tag]}
    params: list[dict[str, Any]] = []
    if "{session_id}" in ep.path:
        params.append({
            "name": "session_id", "in": "path", "required": True,
            "description": "Session id, chosen by the client.",
            "schema": {"type": "string", "minLength": 1, "maxLength": s.SESSION_ID_MAX,
                       "pattern": s.SESSION_ID_PATTERN},
        })
    if ep.request is not None and "timeout_s" in ep.request.model_fields:
        params.append({
            "name": "X-Request-Timeout", "in": "header", "required": False,
            "description": "Deadline in seconds, as the body's timeout_s; the shorter wins.",
            "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": s.MAX_TIMEOUT_S},
        })
    if params:
        op["parameters"] = params
    if ep.request is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(ep.request)}}}
        if ep.request is s.DecodeRequest:
            op["requestBody"]["required"] = False  # every field has a default; an empty body decodes 128 tokens
    if ep.response is not None:
        ok: dict[str, Any] = {ep.content: {"schema": _ref(ep.response)}}
    elif ep.content == "application/json":
        ok = {ep.content: {"schema": {"type": "object"}}}
    else:
        ok = {ep.content: {"schema": {"type": "string"}}}
    if ep.stream:
        ok["text/event-stream"] = {"schema": {
            "description": _SSE_TEXT, "type": "object", "required": ["event", "data"],
            "properties": {"event": {"enum": [name for name, _ in _SSE_EVENTS]}, "data": {"type": "string"}},
            "oneOf": [{"properties": {"event": {"const": name}, "data": {
                "contentMediaType": "application/json", "contentSchema": _ref(model)}}} for name, model in _SSE_EVENTS],
        }}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    by_status: dict[int, list[str]] = {}
    for kind in ep.errors:
        by_status.setdefault(HTTP_STATUS[kind], []).append(kind)
    for status, kinds in sorted(by_status.items()):
        responses[str(status)] = {
            "description": "; ".join(f"{k}: {_KIND_TEXT[k]}" for k in kinds),
            "content": {"application/json": {"schema": _ref(s.ErrorResponse)}},
        }
    op["responses"] = responses
    return op


def build(vocab_size: int | None = None) -> dict[str, Any]:
    """The document; with ``vocab_size``, for that model (``for_model``)."""
    _, defs = models_json_schema([(m, "validation") for m in _MODELS], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for ep in ENDPOINTS:
        paths.setdefault(ep.path, {})[ep.method.lower()] = _operation(ep)
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "modeld cell worker",
            "version": __version__,
            "description": "The session contract over HTTP. Every session response carries the engine's trace; every "
            "error is {error: {kind, message, details}} with the HTTP status of its kind. See docs/worker.md.",
        },
        "tags": [{"name": "sessions"}, {"name": "model"}, {"name": "operations"}],
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
    return doc if vocab_size is None else for_model(doc, vocab_size)


def for_model(doc: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A copy of ``doc`` (the committed document, or ``build()``) whose model-dependent bounds are numbers: every
    schema marked ``x-maximum`` gets the ``maximum`` it names for a model of ``vocab_size`` token ids."""
    out = copy.deepcopy(doc)
    todo: list[Any] = [out]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if "x-maximum" in node:
                node["maximum"] = vocab_size + _VOCAB_OFFSET[node["x-maximum"]]
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return out


def render(vocab_size: int | None = None) -> str:
    return json.dumps(build(vocab_size), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m modeld_cell.openapi", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {COMMITTED.name} beside this module")
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs from the generated")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        COMMITTED.write_text(text)
        print(f"wrote {COMMITTED}")
    elif args.check:
        if not COMMITTED.exists() or COMMITTED.read_text() != text:
            print(f"{COMMITTED} is stale: run python -m modeld_cell.openapi --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
