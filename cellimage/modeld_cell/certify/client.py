"""A small blocking client for the worker's HTTP API (docs/worker.md): JSON calls, typed errors, a streamed decode
timed on the client's clock. Standard library only, so the certification Job needs nothing beyond the image."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any


class CellError(Exception):
    """A typed error body from the worker (``kind``: overflow, unsupported, timeout, ...) or a transport failure
    (``kind`` = ``transport``); ``status`` is the HTTP status (0 for transport)."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(f"{status} {kind}: {message}")
        self.status, self.kind, self.message = status, kind, message

    @property
    def refused(self) -> bool:
        """The cell cannot do this (context or memory exceeded, mode unsupported), as opposed to failing at it."""
        return self.kind in ("overflow", "unsupported")


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None  # time.perf_counter() when the first token event (or done) arrived
    trace: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None


class Client:
    def __init__(self, base_url: str, timeout_s: float = 1800.0):
        self.base = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _open(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                err = json.loads(raw)["error"]
                raise CellError(e.code, err["kind"], err["message"]) from None
            except (ValueError, KeyError, TypeError):
                raise CellError(e.code, "http", raw[:200].decode(errors="replace")) from None
        except (urllib.error.URLError, OSError) as e:
            raise CellError(0, "transport", f"{self.base}{path}: {e}") from None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(method, path, body) as resp:
            return json.loads(resp.read())

    def ready(self) -> bool:
        try:
            return bool(self.call("GET", "/readyz").get("ready"))
        except CellError:
            return False

    def capability(self) -> dict[str, Any]:
        return self.call("GET", "/v1/capability")

    def tokenize(self, text: str) -> list[int]:
        return self.call("POST", "/v1/tokenize", {"text": text})["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self.call("POST", "/v1/detokenize", {"tokens": tokens})["text"]

    def prefix(self, sid: str, **prompt: Any) -> dict[str, Any]:
        return self.call("POST", f"/v1/sessions/{sid}/prefix", prompt)["trace"]

    def decode(self, sid: str, max_tokens: int) -> dict[str, Any]:
        return self.call("POST", f"/v1/sessions/{sid}/decode", {"max_tokens": max_tokens, "temperature": 0})

    def close(self, sid: str) -> None:
        try:
            self.call("DELETE", f"/v1/sessions/{sid}")
        except CellError:
            pass

    def decode_stream(self, sid: str, max_tokens: int) -> Streamed:
        """Greedy decode over SSE, noting when the first token arrives."""
        out = Streamed()
        with self._open("POST", f"/v1/sessions/{sid}/decode",
                        {"max_tokens": max_tokens, "temperature": 0, "stream": True}) as resp:
            event, data = None, []
            text = []
            for raw in resp:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and event is not None:
                    body = json.loads("\n".join(data))
                    if out.first_token_at is None and event in ("token", "done"):
                        out.first_token_at = time.perf_counter()
                    if event == "token":
                        out.tokens.append(body["id"])
                        text.append(body["text"])
                    elif event == "done":
                        text.append(body.get("text", ""))
                        out.trace, out.finish_reason = body["trace"], body["finish_reason"]
                    elif event == "error":
                        err = body.get("error", {})
                        raise CellError(200, err.get("kind", "error"), err.get("message", ""))
                    event, data = None, []
        out.text = "".join(text)
        if not out.trace:
            raise CellError(200, "transport", "stream ended without a done event")
        return out
