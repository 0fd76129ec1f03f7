"""The session contract over HTTP (aiohttp): JSON in and out, every session response carrying the engine's trace.

The server owns parsing, validation, tokenization of text and chat messages, SSE framing, deadlines, logs and metrics;
everything that touches KV goes through the engine (docs/engine-interface.md). Validation happens before the engine
is called, so a rejected request never changes a session. Engine work is async and tokenization runs in a thread:
no handler blocks the event loop.

Errors: a ContractError becomes its HTTP status and ``to_body()``; any other exception is logged, answered as
``fatal`` (503), and marks the worker not ready, since the engine's state can no longer be vouched for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from . import openapi
from . import schemas as s
from .contract import SessionEngine
from .errors import BadRequest, ContractError, Fatal, MethodNotAllowed, NotFound, NotReady, Overflow, Unsupported
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("modeld_cell.server")
access_log = logging.getLogger("modeld_cell.access")

MAX_BODY_BYTES = 64 * 1024 * 1024  # a context tier of 1M token ids is ~8 MB of JSON; text prompts are larger
SESSION_ID = re.compile(s.SESSION_ID_PATTERN)
INSTANCE = uuid.uuid4().hex          # this process's id (/readyz): it changes when the process is replaced
TIMEOUT_HEADER = "X-Request-Timeout"
# A system message the continuation renderer puts in front of suffix messages and cuts off again: templates that
# inject a default system prompt when the first message is not one would otherwise repeat it mid-session.
_ANCHOR = [{"role": "system", "content": "modeld"}]

M = TypeVar("M", bound=BaseModel)
# Typed request-storage keys where aiohttp has them (3.13+); plain strings before, which it accepts with a warning.
_RK = getattr(web, "RequestKey", None)
T0: Any = _RK("t0", float) if _RK else "t0"
LOG: Any = _RK("log", dict) if _RK else "log"


class Worker:
    """Per-app state: the engine (None while loading), settings, metrics and the fatal flag."""

    def __init__(self, settings: Settings, engine: SessionEngine | None = None, model_name: str = "") -> None:
        self.settings = settings
        self.metrics = Metrics(model_name)
        self.engine: SessionEngine | None = None
        self.fatal: ContractError | None = None
        # the spec was refused at start (a value not served, a profile whose measured smoke fails): every route
        # answers it, /readyz included, while /healthz stays up, so the pod does not restart into the same refusal
        self.refusal: ContractError | None = None
        self.draining = False                       # SIGTERM received (drain)
        self.metrics.bind_engine(self._engine_gauges, self._cache_config)
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: SessionEngine) -> None:
        """Makes the loaded engine serve; until then engine routes answer not_ready."""
        self.engine = engine

    # ---- plumbing ----

    def refuse(self, err: ContractError) -> None:
        """The engine will not load for a reason the spec carries: answer it instead of serving."""
        self.refusal = err

    def drain(self) -> None:
        """SIGTERM: new requests answer not_ready (503, so clients and load balancers go elsewhere) while the ones
        in flight finish; cli.serve then waits for them before stopping the engine."""
        self.draining = True

    def _ready_engine(self) -> SessionEngine:
        if self.draining:
            raise NotReady("the worker is shutting down (SIGTERM): requests in flight finish, new ones go elsewhere")
        if self.refusal is not None:
            r = self.refusal
            raise type(r)(f"the worker refused its cell spec at start: {r.message}", refused=True, **r.details)
        if self.engine is None:
            raise NotReady("the model is still loading; retry shortly")
        if self.fatal is not None:
            raise Fatal("the worker hit a fatal error and is not ready", cause=self.fatal.message)
        if not self.engine.ready:
            raise Fatal("the engine is not ready after a fatal backend error")
        return self.engine

    @staticmethod
    async def _body(request: web.Request, model: type[M]) -> M:
        raw = await request.read()
        if raw.strip():
            try:
                obj = s.loads(raw)
            except UnicodeDecodeError:
                raise BadRequest("the body is not UTF-8 text", field="body") from None
            except json.JSONDecodeError as e:
                raise BadRequest(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", field="body") from None
        else:
            obj = {}
        if not isinstance(obj, dict):
            raise BadRequest(f"the body must be a JSON object, not {type(obj).__name__}", field="body")
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e) from None

    @staticmethod
    def _session_id(request: web.Request) -> str:
        sid = request.match_info["session_id"]
        if not SESSION_ID.fullmatch(sid):
            raise BadRequest(f"session id {sid[:140]!r} must match {s.SESSION_ID_PATTERN}", field="session_id")
        request[LOG]["session"] = sid
        return sid

    @staticmethod
    def _deadline(request: web.Request, body_timeout: float | None) -> float | None:
        """Absolute ``time.monotonic()`` deadline from the body's timeout_s and the header; the shorter wins."""
        limits = [body_timeout] if body_timeout is not None else []
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                t = float(raw)
            except ValueError:
                t = math.nan
            if not (math.isfinite(t) and 0 < t <= s.MAX_TIMEOUT_S):
                raise BadRequest(f"{TIMEOUT_HEADER} must be seconds in (0, {s.MAX_TIMEOUT_S:g}], got {raw[:40]!r}",
                                 field=TIMEOUT_HEADER)
            limits.append(t)
        return request[T0] + min(limits) if limits else None

    def _check_ids(self, ids: list[int], field: str) -> None:
        vocab = int(self._ready_engine().tokenizer.vocab_size)
        if not ids or max(ids) < vocab:  # max() runs in C: long prompts are checked without a Python loop
            return
        for i, t in enumerate(ids):
            if t >= vocab:
                raise BadRequest(f"{field}[{i}] = {t} is not a token id of this model (0..{vocab - 1})",
                                 field=f"{field}[{i}]", vocab_size=vocab)

    async def _prompt(self, body: s._TextInput, *, continuation: bool, add_generation_prompt: bool) -> list[int]:
        tok = self._ready_engine().tokenizer
        ids_given = getattr(body, "tokens", None)       # _PromptInput's; tokenize takes text or messages only
        if ids_given is not None:
            self._check_ids(ids_given, "tokens")
            return list(ids_given)
        if body.text is not None:
            text = body.text
        else:
            assert body.messages is not None
            messages = [m.model_dump() for m in body.messages]
            agp = add_generation_prompt if body.add_generation_prompt is None else body.add_generation_prompt
            text = await asyncio.to_thread(_render_chat, tok, messages, agp, continuation)
        ids = list(await asyncio.to_thread(tok.encode, text))
        bos = getattr(tok, "bos_token_id", None)
        if (continuation and getattr(tok, "add_bos", False) and ids and ids[0] == bos
                and not text.startswith(str(tok.decode([bos])))):
            ids = ids[1:]  # a tokenizer's automatic BOS in the middle of a session would restart the sequence
        return ids

    def _trace(self, request: web.Request, trace: Any) -> dict[str, Any]:
        d = _as_dict(trace)
        if request.get("restored") is not None:
            d["restored"] = request["restored"]
        self.metrics.observe_trace(d)
        request[LOG]["tokens"] = int(d.get("prompt_tokens") or 0) + int(d.get("completion_tokens") or 0)
        return d

    def _engine_gauges(self) -> Mapping[str, Any] | None:
        if self.engine is None:
            return None
        m = self.engine.metrics()
        # The engine's names are mapped to the exported ones here, the one place that knows both sides.
        return {
            "num_requests_running": float(m.get("num_requests_running", 0)),
            "num_requests_waiting": float(m.get("num_requests_waiting", 0)),
            "kv_cache_usage_perc": float(m.get("kv_cache_usage_perc", 0.0)),
            "sessions_active": float(m.get("sessions", 0)),
            "prefix_cache_blocks": float(m.get("prefix_cache_blocks", 0)),
            "prefix_cache_evictions": float(m.get("prefix_cache_evictions", 0)),
        }

    def _cache_config(self) -> Mapping[str, Any] | None:
        if self.engine is None:
            return None
        cfg = self.engine.metrics().get("cache_config_info") or {}
        # vLLM's label names, so the llm-d scheduler reads them; num_gpu_blocks counts the pool on any device.
        return {"block_size": cfg.get("block_size", ""), "cache_dtype": cfg.get("kv_dtype", ""),
                "num_gpu_blocks": cfg.get("num_blocks", "")}

    # ---- session routes ----

    async def _recover(self, request: web.Request, engine: Any, sid: str, create: bool = False) -> None:
        """A session the worker lost (process restarted) comes back from the session store before the request runs
        (engine.recover; the trace says ``restored``). When its stored state is unusable, a request that needs the
        session answers not_found with the reason; one that creates it (``create``) starts it afresh and says so."""
        info = await engine.recover(sid)
        if info is None:
            return
        request["restored"] = info
        request[LOG]["restored"] = info.get("tokens_restored", "lost")
        if "lost" in info and not create:
            raise NotFound(f"session {sid!r} was lost: {info['lost']}", session_id=sid, lost=info["lost"])

    async def ensure_prefix(self, request: web.Request) -> web.Response:
        sid = self._session_id(request)
        body = await self._body(request, s.PrefixRequest)
        engine = self._ready_engine()
        deadline = self._deadline(request, body.timeout_s)
        tokens = await self._prompt(body, continuation=False, add_generation_prompt=False)
        await self._recover(request, engine, sid, create=True)
        trace = await engine.ensure_prefix(sid, tokens, deadline=deadline, cache_salt=body.cache_salt)
        return _json({"session_id": sid, "trace": self._trace(request, trace)})

    async def prefill_suffix(self, request: web.Request) -> web.Response:
        sid = self._session_id(request)
        body = await self._body(request, s.SuffixRequest)
        engine = self._ready_engine()
        deadline = self._deadline(request, body.timeout_s)
        # An empty suffix is valid: it runs only the session's pending last generated token (trace says so).
        tokens = await self._prompt(body, continuation=True, add_generation_prompt=True)
        await self._recover(request, engine, sid)
        trace = await engine.prefill_suffix(sid, tokens, deadline=deadline)
        return _json({"session_id": sid, "trace": self._trace(request, trace)})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        body = await self._body(request, s.DecodeRequest)
        engine = self._ready_engine()
        deadline = self._deadline(request, body.timeout_s)
        self._check_ids(body.stop_token_ids, "stop_token_ids")
        params = _sampling_params(body)
        await self._recover(request, engine, sid)
        events = engine.decode(sid, params, body.max_tokens, stop_token_ids=list(body.stop_token_ids),
                               stop=list(body.stop), deadline=deadline, ignore_eos=body.ignore_eos)
        if body.stream:
            return await self._stream(request, sid, events)
        ids: list[int] = []
        pieces: list[str] = []
        try:
            async for ev in events:
                if getattr(ev, "done", False):
                    pieces.append(ev.text or "")
                    trace = self._trace(request, ev.trace)
                    ids = self._generated_ids(sid, ids, trace)
                    request[LOG]["finish"] = ev.finish_reason
                    return _json({"session_id": sid, "tokens": ids, "text": "".join(pieces),
                                  "finish_reason": ev.finish_reason, "trace": trace})
                assert ev.token_id is not None              # a token event (not the done event)
                ids.append(ev.token_id)
                pieces.append(ev.text or "")
                if _client_gone(request):
                    # Nobody will read the answer: stop generating. aclose() below leaves the session consistent.
                    request[LOG]["finish"] = "client_gone"
                    return web.Response(status=499)
        finally:
            await _aclose(events)
        raise Fatal("the engine ended decoding without a done event", session_id=sid)

    def _generated_ids(self, sid: str, streamed: list[int], trace: Mapping[str, Any]) -> list[int]:
        """Every id the decode added to the session. A stop token (EOS or stop_token_ids) enters the session and
        the count but has no token event; read it from the session so ``len(tokens) == completion_tokens``. Called
        while the engine still holds the session (the done event is being handled), so nothing can interleave."""
        n = int(trace.get("completion_tokens") or 0)
        if self.engine is None or n <= len(streamed):
            return streamed
        return list(self.engine.session_tokens(sid)[-n:]) if n else []

    async def _stream(self, request: web.Request, sid: str, events: Any) -> web.StreamResponse:
        # The first event is awaited before any byte is sent, so refusals (not_found, conflict, overflow, ...) are
        # still answered with their own HTTP status and JSON body instead of a 200 stream with an error event.
        try:
            ev = await events.__anext__()
        except StopAsyncIteration:
            raise Fatal("the engine ended decoding without a done event", session_id=sid) from None
        except BaseException:
            await _aclose(events)
            raise
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        n = 0
        try:
            await resp.prepare(request)
            while True:
                if getattr(ev, "done", False):
                    trace = self._trace(request, ev.trace)
                    # text: whatever the engine held back to the end (a possible stop-string prefix, an
                    # unfinished character); append it like a token's text.
                    await _sse(resp, "done", {"finish_reason": ev.finish_reason, "text": ev.text or "",
                                              "trace": trace})
                    request[LOG]["finish"] = ev.finish_reason
                    break
                await _sse(resp, "token", {"id": int(ev.token_id), "text": ev.text or ""})
                n += 1
                ev = await events.__anext__()
        except ConnectionError:
            # The client went away mid-stream; closing the iterator (finally) stops the decode and the session keeps
            # the tokens generated so far.
            request[LOG].update(finish="client_gone", tokens=n)
        except ContractError as e:
            self._observe_error(e)
            request[LOG].update(error=e.kind, tokens=n)
            with contextlib.suppress(ConnectionError):
                await _sse(resp, "error", e.to_body())
        except StopAsyncIteration:
            err = Fatal("the engine ended decoding without a done event", session_id=sid)
            self._mark_fatal(err, None)
            with contextlib.suppress(ConnectionError):
                await _sse(resp, "error", err.to_body())
        except Exception as e:
            err = Fatal(f"internal error while decoding: {type(e).__name__}", session_id=sid)
            self._mark_fatal(err, e)
            request[LOG].update(error=err.kind, tokens=n)
            with contextlib.suppress(ConnectionError):
                await _sse(resp, "error", err.to_body())
        finally:
            await _aclose(events)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    async def snapshot(self, request: web.Request) -> web.Response:
        sid = self._session_id(request)
        body = await self._body(request, s.SnapshotRequest)
        engine = self._ready_engine()
        path = self._snapshot_path(body.path)
        await self._recover(request, engine, sid)
        t = time.monotonic()
        info = await engine.snapshot(sid, path)
        self.metrics.snapshot_seconds.labels(self.metrics.model_name).observe(time.monotonic() - t)
        return _json({"session_id": sid, "path": path, "snapshot": _as_dict(info)})

    async def restore(self, request: web.Request) -> web.Response:
        sid = self._session_id(request)
        body = await self._body(request, s.RestoreRequest)
        engine = self._ready_engine()
        path = self._snapshot_path(body.path)
        if not await asyncio.to_thread(Path(path).is_file):
            raise NotFound(f"no snapshot file {body.path!r}", field="path")
        t = time.monotonic()
        trace = await engine.restore(sid, path, body.cache_salt)
        self.metrics.restore_seconds.labels(self.metrics.model_name).observe(time.monotonic() - t)
        return _json({"session_id": sid, "trace": self._trace(request, trace)})

    def _snapshot_path(self, given: str) -> str:
        root = Path(self.settings.snapshot_dir).resolve()
        try:
            p = (root / given).resolve()
        except (ValueError, OSError) as e:
            raise BadRequest(f"path {given!r} is not a usable file name: {e}", field="path") from None
        if p == root or not p.is_relative_to(root):
            raise BadRequest(f"path {given!r} must name a file inside the snapshot directory", field="path",
                             snapshot_dir=str(root))
        return str(p)

    async def close_session(self, request: web.Request) -> web.Response:
        sid = self._session_id(request)
        engine = self._ready_engine()
        if engine.forget_stored(sid):       # a session only the store holds (lost with the process): dropped there
            return _json({"session_id": sid, "closed": True})
        engine.close_session(sid)  # NotFound / Conflict (a request running) come from the engine
        return _json({"session_id": sid, "closed": True})

    async def get_session(self, request: web.Request) -> web.Response:
        sid = self._session_id(request)
        engine = self._ready_engine()
        await self._recover(request, engine, sid)
        tokens = engine.session_tokens(sid)  # NotFound from the engine
        entry = next((e for e in engine.sessions() if e.get("session_id") == sid), {"session_id": sid})
        out: dict[str, Any] = {"session": _as_dict(entry), "tokens": tokens}
        if request.get("restored") is not None:
            out["restored"] = request["restored"]      # recovered from the session store by this request
        return _json(out)

    async def list_sessions(self, request: web.Request) -> web.Response:
        engine = self._ready_engine()
        return _json({"sessions": [_as_dict(x) for x in engine.sessions()]})

    # ---- model routes ----

    async def capability(self, request: web.Request) -> web.Response:
        return _json(_as_dict(self._ready_engine().capability()))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request, s.TokenizeRequest)
        self._ready_engine()
        ids = await self._prompt(body, continuation=False, add_generation_prompt=False)
        request[LOG]["tokens"] = len(ids)
        return _json({"tokens": ids, "count": len(ids)})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request, s.DetokenizeRequest)
        engine = self._ready_engine()
        self._check_ids(body.tokens, "tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, list(body.tokens))
        return _json({"text": text})

    # ---- operations ----

    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        self._ready_engine()
        return _json({"ready": True, "instance": INSTANCE})

    async def metrics_route(self, request: web.Request) -> web.Response:
        # Rendered on the loop thread: the collectors read engine state that only the loop thread mutates.
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def openapi_route(self, request: web.Request) -> web.Response:
        # With a model loaded, its bounds are numbers (token ids below its vocabulary size, top_k at most it).
        vocab = int(self.engine.tokenizer.vocab_size) if self.engine is not None else None
        return web.Response(text=openapi.render(vocab), content_type="application/json")

    # ---- errors and logs ----

    def _mark_fatal(self, err: ContractError, exc: BaseException | None) -> None:
        self.fatal = err
        self.metrics.observe_error(err.kind)
        log.error("fatal: %s; the worker is now not ready", err.message, exc_info=exc)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        request[T0] = time.monotonic()
        request[LOG] = {}
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except ContractError as e:
            return self._error(request, e)
        except web.HTTPException as e:
            return self._error(request, _http_error(request, e))
        except asyncio.CancelledError:
            status = 499  # the client went away and aiohttp cancelled the handler
            raise
        except Exception as e:
            err = Fatal(f"internal error: {type(e).__name__}: {e}"[:500])
            self._mark_fatal(err, e)
            return self._error(request, err, counted=True)
        finally:
            if "status" in request[LOG]:
                status = request[LOG].pop("status")
            self._log(request, status)

    def _observe_error(self, e: ContractError) -> None:
        self.metrics.observe_error(e.kind)
        partial = e.details.get("trace")
        if isinstance(partial, dict):
            self.metrics.observe_trace(partial)  # a timeout still generated or computed tokens: count them

    def _error(self, request: web.Request, e: ContractError, counted: bool = False) -> web.Response:
        if not counted:
            self._observe_error(e)
        request[LOG].update(status=e.http_status, error=e.kind)
        headers = {"Allow": ", ".join(e.details["allowed"])} if isinstance(e, MethodNotAllowed) else None
        return _json(e.to_body(), status=e.http_status, headers=headers)

    def _log(self, request: web.Request, status: int) -> None:
        info = request.match_info
        route = info.route.resource.canonical if info.route.resource is not None else "unmatched"
        self.metrics.http_requests.labels(route, str(status)).inc()
        elapsed = time.monotonic() - request[T0]
        if status == 200 and route.startswith(openapi.SESSION) and request.method == "POST":
            self.metrics.e2e.labels(self.metrics.model_name).observe(elapsed)
        if request.path in ("/healthz", "/readyz", "/metrics") and status < 400:
            return  # probes and scrapes would drown the request log
        fields = {"method": request.method, "path": request.path, "status": status,
                  "ms": round(elapsed * 1e3, 2)}
        fields.update(request[LOG])
        access_log.info("request", extra={"fields": fields})


# ---- helpers ----


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(obj, separators=(",", ":"), default=_json_default), status=status,
                        content_type="application/json", headers=headers)


def _json_default(o: Any) -> Any:
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return _as_dict(o)
    if hasattr(o, "tolist"):
        return o.tolist()  # numpy / torch scalars and arrays
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _as_dict(x: Any) -> dict[str, Any]:
    if x is None:
        return {}
    if hasattr(x, "to_dict"):
        return dict(x.to_dict())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    return dict(x)


def _validation_error(e: ValidationError) -> BadRequest:
    errors = []
    for err in e.errors(include_url=False, include_input=False, include_context=False):
        field = _loc(err["loc"]) or "body"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        errors.append({"field": field, "message": msg, "type": err["type"]})
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return BadRequest(f"{first['field']}: {first['message']}{more}", field=first["field"], errors=errors[:20])


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _http_error(request: web.Request, e: web.HTTPException) -> ContractError:
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = sorted(e.allowed_methods)
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}; use {', '.join(allowed)}",
                                method=request.method, allowed=allowed)
    if isinstance(e, web.HTTPNotFound):
        return NotFound(f"no route {request.method} {request.path}", route=request.path)
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return Overflow(f"the body exceeds {MAX_BODY_BYTES} bytes", field="body", limit_bytes=MAX_BODY_BYTES)
    if 400 <= e.status < 500:
        return BadRequest(f"{e.status} {e.reason}", http_status=e.status)
    return Fatal(f"{e.status} {e.reason}")


def _render_chat(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool, continuation: bool) -> str:
    if getattr(tok, "chat_template", True) is None:
        raise Unsupported("this model has no chat template; send text or tokens", field="messages")
    from jinja2 import TemplateError

    try:
        if not continuation:
            return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        base = tok.apply_chat_template(_ANCHOR, add_generation_prompt=False)
        full = tok.apply_chat_template(_ANCHOR + messages, add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        # Templates reject what they cannot render (e.g. roles out of order) with raise_exception(...).
        raise BadRequest(f"the chat template refused these messages: {e}", field="messages") from None
    if not full.startswith(base):
        raise Unsupported("this model's chat template cannot render messages as a continuation; send text or tokens",
                          field="messages")
    return full[len(base):]


def _sampling_params(body: s.DecodeRequest) -> Any:
    from .engine import SamplingParams  # the engine pulls in torch; import it only where it is needed

    # The engine's decode() validates these again against the vocabulary and raises BadRequest naming the field.
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)


async def _sse(resp: web.StreamResponse, event: str, data: Any) -> None:
    payload = json.dumps(data, separators=(",", ":"), default=_json_default)
    await resp.write(f"event: {event}\ndata: {payload}\n\n".encode())


async def _aclose(events: Any) -> None:
    close = getattr(events, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except RuntimeError:
        # "aclose(): asynchronous generator is already running": a cancelled __anext__ is still unwinding; the
        # engine's own cancellation handling finishes the cleanup.
        log.debug("decode iterator was still running at close", exc_info=True)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


WORKER = web.AppKey("worker", Worker)


def create_app(settings: Settings | None = None, engine: SessionEngine | None = None,
               model_name: str = "") -> web.Application:
    """The aiohttp app; pass ``engine`` now, or later with ``app[WORKER].attach(engine)`` once it has loaded."""
    worker = Worker(settings or Settings.from_env(), engine=engine, model_name=model_name)
    app = web.Application(middlewares=[worker.middleware], client_max_size=MAX_BODY_BYTES)
    app[WORKER] = worker
    handlers = {
        "metrics": worker.metrics_route,
        "openapi": worker.openapi_route,
    }
    for ep in openapi.ENDPOINTS:
        handler = handlers.get(ep.operation_id) or getattr(worker, ep.operation_id)
        app.router.add_route(ep.method, ep.path, handler, name=ep.operation_id)
    from .openai_api import OpenAIRoutes  # OpenAI's API on the same engine (its own module: it imports this one)

    app.router.add_routes(OpenAIRoutes(worker).routes())
    return app

