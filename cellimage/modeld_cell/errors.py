"""The worker's one exception tree.

Every failure a client can see is a ContractError. Its ``kind`` is the session contract's error class and decides the
HTTP status; ``to_body()`` is the JSON error body every endpoint returns. An error never leaves a session half-updated:
code raises before it mutates, or rolls back first.

    kind        HTTP  meaning
    bad_request 400   malformed JSON, invalid token ids, absurd sampling parameters
    not_found   404   unknown session or snapshot
    conflict    409   the session's state refuses a valid request now: one is already running on it (requests on
                      one session are serialized), it was created under another cache_salt, it holds no tokens to
                      decode from, or a snapshot path collides with what the snapshot directory holds
    overflow    413   context or memory exceeded; refused, session state untouched
    clamp       200*  not raised: a request was cut to fit (e.g. max_tokens); reported in the trace's ``clamped``
    fallback    200*  not raised: a requested mode ran on a slower path; reported in the trace's ``fallback``
    timeout     504   deadline exceeded; partial output reported in ``details``
    unsupported 501   the cell cannot do this (e.g. snapshot on a cell that lists it as unsupported)
    fatal       503   the backend is in a bad state; the worker marks itself not ready
    not_ready   503   the worker is still loading its model; retry later (not a failure)
    method_not_allowed 405  the route exists but not with this HTTP method
"""

from __future__ import annotations

from typing import Any

HTTP_STATUS = {
    "bad_request": 400,
    "not_found": 404,
    "conflict": 409,
    "overflow": 413,
    "clamp": 200,
    "fallback": 200,
    "timeout": 504,
    "unsupported": 501,
    "fatal": 503,
    "not_ready": 503,
    "method_not_allowed": 405,
}


class ContractError(Exception):
    kind = "fatal"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.kind]

    def to_body(self) -> dict[str, Any]:
        return {"error": {"kind": self.kind, "message": self.message, "details": self.details}}


class BadRequest(ContractError):
    kind = "bad_request"


class NotFound(ContractError):
    kind = "not_found"


class Conflict(ContractError):
    kind = "conflict"


class Overflow(ContractError):
    kind = "overflow"


class Timeout(ContractError):
    kind = "timeout"


class Unsupported(ContractError):
    kind = "unsupported"


class Fatal(ContractError):
    kind = "fatal"


class NotReady(ContractError):
    kind = "not_ready"


class MethodNotAllowed(ContractError):
    kind = "method_not_allowed"
