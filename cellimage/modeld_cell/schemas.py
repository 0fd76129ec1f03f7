"""Request and response bodies of the worker's HTTP API: the single source of the OpenAPI document.

Request models are strict (a string is not a number, ``true`` is not ``1``), forbid unknown fields and reject NaN and
infinities, so a typo or a wrong type is a 400 naming the field instead of a silently ignored value. JSON text is read
as JSON Schema reads it (``loads``): ``2.0`` and ``2e3`` are integers. Every rule a model checks by hand has its form
in the document beside it (``json_schema_extra``), so a request the document allows is one the models accept.

Bounds that depend on the loaded model are marked ``x-maximum`` (token ids below the vocabulary size, top_k at most
it): the server checks them against the engine, and the document a worker serves states them as numbers
(``openapi.build(vocab_size=...)``). Prompts within the context tier and the KV budget are runtime outcomes
(``overflow``); the static bounds here only stop absurd values early.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict, JsonValue

from .errors import HTTP_STATUS

# ECMA-262 semantics, as JSON Schema reads a pattern: the server matches it with re.fullmatch (``$`` in Python's re
# also matches before a trailing newline).
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SESSION_ID_MAX = 128
# A snapshot path: relative, "/"-separated names that start with a letter, digit or "_" (so no "." or ".." segment, no
# leading "/"), each at most 128 characters (file systems allow 255 bytes), at most 1024 in all.
_PATH_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
SNAPSHOT_PATH_PATTERN = rf"^{_PATH_NAME}(/{_PATH_NAME})*$"
# The largest context tier a Cell may declare (operator api.CellSpec.contextTier); more tokens is never a prompt.
MAX_TOKENS_PER_REQUEST = 1_048_576
MAX_TIMEOUT_S = 86_400.0
# Model-dependent maxima (module docstring): openapi.build(vocab_size=...) turns each into "maximum".
BELOW_VOCAB: JsonDict = {"x-maximum": "vocab_size - 1"}
UP_TO_VOCAB: JsonDict = {"x-maximum": "vocab_size"}
_INTEGRAL_MAX = 1e30  # larger integral numbers stay floats: beyond every integer field's maximum, and no huge int()


def loads(raw: bytes | str) -> Any:
    """JSON text to Python, numbers as JSON Schema reads them: one with an integral value is an int (``2.0``, ``2e3``),
    exactly (``9223372036854775807.0`` stays that integer, ``1.0000000000000000001`` stays a float). Raises what
    ``json.loads`` raises."""
    return json.loads(raw, parse_float=_number)


def _number(text: str) -> int | float:
    x = float(text)
    if x.is_integer() and abs(x) <= _INTEGRAL_MAX:
        d = Decimal(text)
        if d == d.to_integral_value():
            return int(d)
    return x


TokenId = Annotated[int, Field(ge=0, description="Token id; must be below the model's vocabulary size.",
                               json_schema_extra=BELOW_VOCAB)]
TokenList = Annotated[list[TokenId], Field(max_length=MAX_TOKENS_PER_REQUEST)]
TimeoutS = Annotated[
    float | None,
    Field(
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Deadline for this request in seconds from its arrival (the X-Request-Timeout header does the same; "
        "the shorter wins). Past it the request ends with a timeout error carrying any partial output.",
    ),
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    # The engine may report more than the documented fields; pass them on rather than drop them.
    model_config = ConfigDict(extra="allow")


class Message(_Request):
    role: str = Field(pattern=r"^[a-z_]{1,32}$", description="system, user, assistant or tool.")
    content: str = Field(max_length=16 * 1024 * 1024, description="Message text.")


# The JSON type of each prompt input when it is given (not null).
_INPUT_TYPES = {"tokens": "array", "text": "string", "messages": "array"}


def _exactly_one(*inputs: str) -> JsonDict:
    """The document's form of ``_exactly_one_input``: one branch per input, which is given and not null while the
    others are absent or null (null is absent); add_generation_prompt is absent or null unless the input is messages."""
    branches: list[JsonValue] = []
    for name in inputs:
        props: JsonDict = {other: {"type": "null"} for other in inputs if other != name}
        props[name] = {"type": _INPUT_TYPES[name]}
        if name != "messages":
            props["add_generation_prompt"] = {"type": "null"}
        branches.append({"required": [name], "properties": props})
    return {"oneOf": branches}


class _TextInput(_Request):
    """A prompt as text or chat messages (exactly one); ``_PromptInput`` adds token ids."""

    INPUTS: ClassVar[tuple[str, ...]] = ("text", "messages")
    model_config = ConfigDict(json_schema_extra=_exactly_one(*INPUTS))

    text: str | None = Field(default=None, max_length=16 * 1024 * 1024, description="Text, tokenized without a template.")
    messages: list[Message] | None = Field(
        default=None, min_length=1, max_length=4096, description="Chat messages, rendered with the model's chat template."
    )
    add_generation_prompt: bool | None = Field(
        default=None,
        description="With messages: end with the assistant header so decoding writes the reply. Default: false for "
        "/prefix and /tokenize, true for /suffix.",
    )

    @model_validator(mode="after")
    def _exactly_one_input(self) -> _TextInput:
        given = [k for k in self.INPUTS if getattr(self, k) is not None]
        if len(given) != 1:
            options = f"{', '.join(self.INPUTS[:-1])} or {self.INPUTS[-1]}"
            raise ValueError(f"give exactly one of {options} (got {', '.join(given) or 'none'})")
        if self.add_generation_prompt is not None and self.messages is None:
            raise ValueError("add_generation_prompt applies only to messages")
        return self


class _PromptInput(_TextInput):
    INPUTS: ClassVar[tuple[str, ...]] = ("tokens", "text", "messages")
    model_config = ConfigDict(json_schema_extra=_exactly_one(*INPUTS))

    tokens: TokenList | None = Field(default=None, description="Token ids, used as given.")


CacheSalt = Annotated[str | None, Field(
    min_length=1, max_length=256,
    description="The cache scope of a new session (vLLM's cache_salt): its prompt blocks are shared only with sessions "
    "created with the same salt, and its trace reports reuse only of what that scope holds. Without one, the "
    "session is in the cell's one unsalted scope. Keep it secret per tenant. A session keeps the scope it was "
    "created in: naming another later is refused (409 conflict, field cache_salt).")]


class PrefixRequest(_PromptInput):
    """EnsurePrefix: afterwards the session's KV holds exactly this prompt. Creates the session if absent; keeps the
    longest common prefix with what it holds, drops the rest and computes only the remainder."""

    timeout_s: TimeoutS = None
    cache_salt: CacheSalt = None


class SuffixRequest(_PromptInput):
    """PrefillSuffix: appends to the session's KV. With messages, renders them as a continuation of the
    conversation (no second system prompt)."""

    timeout_s: TimeoutS = None


class DecodeRequest(_Request):
    """Generates from the session's current end; the generated tokens stay in the session."""

    max_tokens: int = Field(
        default=128,
        ge=1,
        le=MAX_TOKENS_PER_REQUEST,
        description="Tokens to generate at most. More than the context tier leaves room for is clamped (trace.clamped).",
    )
    temperature: float = Field(default=0.0, ge=0.0, le=10.0, description="0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, (0, 1].")
    top_k: int = Field(default=0, ge=0, description="0 is off; at most the vocabulary size.",
                       json_schema_extra=UP_TO_VOCAB)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Sampling seed; same seed, same output.")
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=16, description="Stop strings; the output ends before the first one."
    )
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=64, description="Token ids that end the output (besides the model's EOS)."
    )
    ignore_eos: bool = Field(default=False, description="Keep generating past the model's EOS tokens (they stay in "
                             "the output), so max_tokens alone ends it, as vLLM's ignore_eos; benchmarks use it to fix "
                             "the output length. stop and stop_token_ids still end it.")
    stream: bool = Field(default=False, description="Server-sent events (token, then done or error) instead of one JSON.")
    timeout_s: TimeoutS = None


class SnapshotRequest(_Request):
    path: str = Field(
        min_length=1,
        max_length=1024,
        pattern=SNAPSHOT_PATH_PATTERN,
        description="Snapshot file, relative to the worker's snapshot directory (<MODELD_CACHE_DIR>/snapshots): "
        "\"/\"-separated names of letters, digits, \".\", \"_\" and \"-\", each starting with a letter, digit or \"_\" (so "
        "it never leaves that directory). A name that is a file where a folder is needed, or a folder where the file "
        "goes, is a conflict.",
    )


class RestoreRequest(SnapshotRequest):
    """Replaces the session's state with the snapshot's. A corrupt snapshot, or one from another model or cell
    profile, is refused and the session is left as it was."""

    cache_salt: CacheSalt = None


class TokenizeRequest(_TextInput):
    """Text or chat messages to token ids (token ids are not an input here)."""


class DetokenizeRequest(_Request):
    tokens: TokenList = Field(description="Token ids to turn into text.")


# ---- responses ----


class TraceTotals(_Response):
    prompt_tokens: int
    completion_tokens: int
    tokens_reused: int
    tokens_computed: int


class Trace(_Response):
    """What the request did and cost. Token accounting adds up: tokens_reused + tokens_computed == prompt_tokens for
    a prefill, and ``totals`` accumulates every request of the session."""

    session_id: str
    prompt_tokens: int = Field(description="Input tokens this request brought.")
    completion_tokens: int = Field(description="Tokens this request generated.")
    tokens_reused: int = Field(description="Prompt tokens served from KV already present.")
    tokens_computed: int = Field(description="Prompt tokens that ran through prefill.")
    session_tokens: int = Field(description="Tokens the session's KV holds after the request.")
    kv_bytes: int = Field(description="Bytes of KV the session holds after the request.")
    queue_ms: float = Field(description="Time waiting for the session or a batch slot.")
    prefill_ms: float
    first_output_ms: float | None = Field(description="From arrival to the first generated token; null without decode.")
    decode_ms_per_token: list[float]
    total_ms: float
    clamped: dict[str, Any] | None = Field(
        description='A limit cut the request, e.g. {"field": "max_tokens", "requested": 900, "granted": 310, '
        '"reason": "context tier"}.'
    )
    fallback: dict[str, Any] | None = Field(
        description='A requested mode ran on another path, e.g. {"requested": "block-sparse", "ran": "dense", '
        '"reason": "prompt shorter than 4096"}.'
    )
    totals: TraceTotals = Field(description="Cumulative over the session.")
    reuse: dict[str, Any] | None = Field(
        default=None,
        description="Prefix lookup (prefix and restore requests; null otherwise): hit, source (session | prefix-cache "
        "| snapshot | null), tokens_reused, bytes_reused, blocks_shared, blocks_copied (copy-on-write at a mid-block "
        "divergence), lookup_ms, time_saved_ms_est (reused tokens at the engine's measured prefill rate); for a "
        "restore: tokens_restored, bytes_read, blocks_written.",
    )
    restore_ms: float | None = Field(
        default=None, description="Restore only: reading, verifying and loading the snapshot, in ms."
    )
    restored: dict[str, Any] | None = Field(
        default=None,
        description="Only on the first request after the worker lost a session it had committed to its session "
        "store (MODELD_SESSION_STORE): tokens_restored, tokens_reused, tokens_computed, restore_ms, committed_at "
        "(the session was recovered before this request ran); or lost, the reason its stored state could not be used.",
    )


class SessionResponse(_Response):
    session_id: str
    trace: Trace


class DecodeResponse(_Response):
    session_id: str
    tokens: list[int] = Field(
        description="Every id the decode added to the session, a final stop token included (len == "
        "trace.completion_tokens)."
    )
    text: str = Field(description="Generated text; a stop string and a stop token's text are not included.")
    finish_reason: str = Field(description="stop (EOS, a stop token or a stop string) or length (max_tokens).")
    trace: Trace


class TokenEvent(_Response):
    """SSE ``event: token``."""

    id: int
    text: str = Field(description="This token's text; may be empty while a multi-byte character is incomplete.")


class DoneEvent(_Response):
    """SSE ``event: done``, the last event of a successful stream."""

    finish_reason: str = Field(description="stop (EOS, a stop token or a stop string) or length (max_tokens).")
    text: str = Field(
        default="", description="Text held back until the end (a possible stop-string prefix); append it."
    )
    trace: Trace


class SnapshotResponse(_Response):
    session_id: str
    path: str = Field(description="The snapshot file as the worker resolved it.")
    snapshot: dict[str, Any] = Field(description="What the engine reports about the snapshot (bytes, tokens, ...).")


class CloseResponse(_Response):
    session_id: str
    closed: bool


class SessionInfoResponse(_Response):
    session: dict[str, Any] = Field(description="The engine's entry: token counts, KV held, busy, totals.")
    tokens: list[int] = Field(description="Token ids the session holds, in order (the KV's content).")
    restored: dict[str, Any] | None = Field(
        default=None, description="Present when this request recovered the session from the session store (the "
        "worker process had lost it): as a trace's restored.")


class SessionsResponse(_Response):
    sessions: list[dict[str, Any]] = Field(description="One entry per live session, as the engine reports it.")


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int


class DetokenizeResponse(_Response):
    text: str


class HealthResponse(_Response):
    status: Literal["ok"]


class ReadyResponse(_Response):
    ready: bool
    instance: str = Field(description="This worker process's id, new at every start: a client (the operator) that sees "
                          "it change knows the process was replaced and what it held in memory is gone.")


class ErrorDetail(_Response):
    kind: Literal[tuple(HTTP_STATUS)]  # type: ignore[valid-type]
    message: str
    details: dict[str, Any] = Field(description="E.g. the offending field, the limit, partial output.")


class ErrorResponse(_Response):
    """Every error, with the HTTP status its kind maps to."""

    error: ErrorDetail
