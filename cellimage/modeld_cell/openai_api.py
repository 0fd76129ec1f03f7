"""OpenAI-compatible routes on the same engine: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or SSE
with ``stream``), ``GET /v1/models`` and vLLM's ``GET /health``, so existing clients, gateways and load tools can
talk to a cell.

Each request is the session contract underneath: the prompt (chat messages rendered with the model's template, or a
completion prompt as text or token ids) goes to EnsurePrefix, the reply comes from Decode. **Session affinity**: with
a header ``x-session-id`` (AIBrix's name) or ``x-session-token`` (llm-d's), the request runs on that contract session,
so an agent that re-sends its whole conversation keeps the KV of everything it sent before (EnsurePrefix keeps the
longest common prefix and computes the rest), and the reply stays in the session. Without one, the request runs on a
session of its own that is closed when it ends; the cell's cross-session prefix cache still serves its prompt. Either
way ``usage.prompt_tokens_details.cached_tokens`` is the prompt tokens served from KV already present, and the
response's extension field ``modeld`` carries the session id and both traces (token accounting, timings, reuse).

What the cell cannot do is refused with a 400 naming the parameter, never ignored: ``n`` other than 1, ``logprobs``,
tools, a response format other than text, penalties other than 0, ``echo``, ``suffix``, ``best_of`` other than 1,
non-text message parts, and unknown fields. Errors use OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``); ``code`` is the contract's error class (``context_length_exceeded`` for a prompt over the context tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from . import schemas as s
from .contract import SamplingParams
from .errors import BadRequest, ContractError, Fatal, NotFound, Overflow
from .server import LOG, _aclose, _render_chat

AFFINITY_HEADERS = ("x-session-id", "x-session-token")
SESSION_ID = re.compile(s.SESSION_ID_PATTERN)
MAX_STOP = 16


class _Request(BaseModel):
    # Unknown fields are refused (a parameter this cell would silently ignore is a wrong answer); numbers may be
    # integers where floats are asked for, as JSON has one number type.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM's: usage so far on every chunk


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(_Request):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=0, le=s.MAX_TOKENS_PER_REQUEST)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="Absent: 1, as OpenAI's default.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, description="Only 1: one choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256,
                                   description="vLLM's name: the cache scope this request's prompt shares blocks in.")
    ignore_eos: bool = Field(default=False, description="vLLM's: EOS does not end the output (max_tokens does).")
    timeout_s: float | None = Field(default=None, gt=0, le=s.MAX_TIMEOUT_S)

    def refused(self) -> tuple[str, str] | None:
        """(parameter, why) for the first value this cell does not serve, else None: a 400 naming it."""
        if self.n not in (None, 1):
            return "n", "this cell returns one choice per request (n=1)"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, "penalties are not served by this cell (0 or absent)"
        stops = self.stops()
        if len(stops) > MAX_STOP or not all(stops):
            return "stop", f"at most {MAX_STOP} non-empty strings"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "only with stream=true"
        return None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else s.MAX_TOKENS_PER_REQUEST


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=s.MAX_TOKENS_PER_REQUEST)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "not served by this cell"
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools", "tool calling is not served by this cell"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format", "only {\"type\": \"text\"} is served by this cell"
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            return "max_completion_tokens", "max_tokens and max_completion_tokens disagree: send one"
        return super().refused()

    def limit(self) -> int:
        return self.max_completion_tokens if self.max_completion_tokens is not None else super().limit()


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "not served by this cell"
        if self.suffix:
            return "suffix", "not served by this cell"
        if self.best_of not in (None, 1):
            return "best_of", "this cell returns one choice per request (best_of=1)"
        if self.logprobs is not None:
            return "logprobs", "not served by this cell"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)) \
                and len(self.prompt) != 1:
            return "prompt", "one prompt per request (a batch of prompts is not served)"
        if not self.prompt:
            return "prompt", "must not be empty"
        return super().refused()


# ---- errors in OpenAI's shape ----

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 501: "invalid_request_error"}


def error_response(e: ContractError) -> web.Response:
    """A contract error as OpenAI's error body; a prompt over the context tier is a 400 ``context_length_exceeded``,
    as OpenAI answers it, every other class keeps the contract's status and names itself in ``code``."""
    status, code = e.http_status, e.kind
    if isinstance(e, Overflow) and "context_tier" in e.details:
        status, code = 400, "context_length_exceeded"
    body = {"error": {"message": e.message, "type": _TYPES.get(status, "server_error"),
                      "param": e.details.get("field"), "code": code}}
    return web.json_response(body, status=status)


# ---- the routes ----

class OpenAIRoutes:
    """The OpenAI routes of one worker (server.Worker: its engine, tokenizer rendering, deadlines, traces, logs)."""

    def __init__(self, worker: Any) -> None:
        self.w = worker

    @property
    def model(self) -> str:
        return str(self.w.metrics.model_name or "modeld")

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self._guard(self.chat)),
                web.post("/v1/completions", self._guard(self.completions)),
                web.get("/v1/models", self._guard(self.models)),
                web.get("/health", self._guard(self.health))]

    async def health(self, request: web.Request) -> web.Response:
        """vLLM's health route, which OpenAI-API load tools and gateways probe: 200 once the worker serves (the
        contract's /readyz, without its body), else the error that says why."""
        self.w._ready_engine()
        return web.json_response({})

    def _guard(self, fn: Callable[[web.Request], Any]) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                return await fn(request)
            except ContractError as e:
                # the worker's middleware logs the request; the error is counted here, in this route's shape
                self.w._observe_error(e)
                request[LOG].update(status=e.http_status, error=e.kind)
                return error_response(e)
        return handler

    async def models(self, request: web.Request) -> web.Response:
        self.w._ready_engine()
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "modeld"}]})

    async def _parse(self, request: web.Request, model: type[_Sampling]) -> Any:
        body = await self.w._body(request, model)     # the contract's reading: JSON as JSON Schema reads it
        if (refusal := body.refused()) is not None:
            raise BadRequest(f"{refusal[0]}: {refusal[1]}", field=refusal[0])
        if body.model != self.model:
            raise NotFound(f"the model {body.model!r} does not exist here; this cell serves {self.model!r}",
                           field="model")
        return body

    def _session(self, request: web.Request) -> tuple[str, bool]:
        """(contract session id, whether it is the client's): the affinity header's, else one of this request's."""
        for name in AFFINITY_HEADERS:
            sid = request.headers.get(name)
            if sid is not None:
                if not SESSION_ID.fullmatch(sid):
                    raise BadRequest(f"{name} {sid[:140]!r} must match {s.SESSION_ID_PATTERN}", field=name)
                return sid, True
        return f"openai-{uuid.uuid4().hex}", False

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatRequest = await self._parse(request, ChatRequest)
        engine = self.w._ready_engine()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = await asyncio.to_thread(_render_chat, engine.tokenizer, messages, True, False)
        ids = list(await asyncio.to_thread(engine.tokenizer.encode, text))
        return await self._run(request, body, ids, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        engine = self.w._ready_engine()
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(await asyncio.to_thread(engine.tokenizer.encode, prompt))
        else:
            self.w._check_ids(prompt, "prompt")
            ids = list(prompt)
        if not ids:
            raise BadRequest("prompt: no tokens to complete from", field="prompt")
        return await self._run(request, body, ids, "text")

    async def _run(self, request: web.Request, body: _Sampling, ids: list[int], kind: str) -> web.StreamResponse:
        engine = self.w._ready_engine()
        sid, affine = self._session(request)
        request[LOG]["session"] = sid
        deadline = self.w._deadline(request, body.timeout_s)
        params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed)
        if affine:
            await self.w._recover(request, engine, sid, create=True)
        try:
            prefix = self.w._trace(request, await engine.ensure_prefix(sid, ids, deadline=deadline,
                                                                       cache_salt=body.cache_salt))
            events = engine.decode(sid, params, body.limit(), stop=body.stops(), deadline=deadline,
                                   ignore_eos=body.ignore_eos)
            reply = Reply(kind, self.model, ids, prefix, sid)
            if body.stream:
                return await self._stream(request, reply, events, body.stream_options or StreamOptions())
            return await self._collect(request, reply, events)
        finally:
            if not affine:                                        # a session of this request only
                with contextlib.suppress(ContractError):
                    engine.close_session(sid)

    async def _collect(self, request: web.Request, reply: Reply, events: AsyncIterator[Any]) -> web.Response:
        pieces: list[str] = []
        try:
            async for ev in events:
                pieces.append(ev.text or "")
                if ev.done:
                    reply.finish(self.w._trace(request, ev.trace), ev.finish_reason)
                    return web.json_response(reply.whole("".join(pieces)))
        finally:
            await _aclose(events)
        raise Fatal("the engine ended decoding without a done event", session_id=reply.sid)

    async def _stream(self, request: web.Request, reply: Reply, events: AsyncIterator[Any],
                      options: StreamOptions) -> web.StreamResponse:
        try:
            ev = await events.__anext__()          # refusals before the first byte keep their own status
        except BaseException:
            await _aclose(events)
            raise
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)

        generated = 0

        async def send(obj: Any) -> None:
            if options.continuous_usage_stats and "usage" not in obj:     # the last chunk counts stop tokens too
                obj["usage"] = reply.usage(None if reply.finish_reason else generated)
            await resp.write(f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode())

        try:
            if reply.kind == "chat":
                await send(reply.chunk({"role": "assistant", "content": ""}))
            while True:
                if ev.done:
                    reply.finish(self.w._trace(request, ev.trace), ev.finish_reason)
                    await send(reply.chunk(ev.text or "", reply.finish_reason))
                    if options.include_usage:
                        await send(reply.usage_chunk())
                    break
                generated += 1
                if ev.text:
                    await send(reply.chunk(ev.text))
                ev = await events.__anext__()
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            request[LOG]["finish"] = "client_gone"
        except ContractError as e:
            self.w._observe_error(e)
            request[LOG]["error"] = e.kind
            with contextlib.suppress(ConnectionError):
                await resp.write(f"data: {error_response(e).text}\n\n".encode())
        finally:
            await _aclose(events)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp


class Reply:
    """One response being built: its id, the prompt's accounting, then the decode's."""

    def __init__(self, kind: str, model: str, prompt: list[int], prefix: dict[str, Any], sid: str) -> None:
        self.kind, self.model, self.prompt, self.prefix, self.sid = kind, model, prompt, prefix, sid
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.decode: dict[str, Any] = {}
        self.finish_reason: str | None = None

    def finish(self, decode: dict[str, Any], reason: str | None) -> None:
        self.decode, self.finish_reason = decode, reason or "stop"

    def usage(self, so_far: int | None = None) -> dict[str, Any]:
        """The request's usage; ``so_far``: tokens generated until now, for a chunk before the last."""
        completion = int(self.decode.get("completion_tokens") or 0) if so_far is None else so_far
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                "total_tokens": len(self.prompt) + completion,
                "prompt_tokens_details": {"cached_tokens": int(self.prefix.get("tokens_reused") or 0)}}

    def _extension(self) -> dict[str, Any]:
        return {"session_id": self.sid, "prefix": self.prefix, "decode": self.decode}

    def whole(self, text: str) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(), "modeld": self._extension()}

    def chunk(self, delta: str | dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta or finish is None else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta if isinstance(delta, str) else "", "logprobs": None,
                      "finish_reason": finish}
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if finish is not None:
            out["modeld"] = self._extension()
        return out

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage()}
