"""Schemathesis against a real worker, from the committed openapi.json: the document says what the server accepts.

Every operation gets MAX_EXAMPLES schema-valid requests (hypothesis, derandomized: CI sends the same requests every
run, and a failure is replayed by running the test again). Each answer must conform to the document (status, content
type, headers, body schema, SSE events) and be a success or one of RUNTIME_OUTCOMES: typed errors that a valid
request meets because of what the worker holds. Never a 400 (the request was valid), never a 5xx but a typed deadline
timeout, and the worker is still ready at the end. Nothing here measures speed.

The document is the committed one with its model-dependent bounds bound to the served model (``openapi.for_model``:
token ids below the vocabulary size), which is also what the worker serves at /openapi.json; the test checks both.
A restore of a corrupt or foreign snapshot file would be a 400 about the file; the fuzzer only ever writes valid ones.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from modeld_cell import openapi, schemas
from modeld_cell.server import TIMEOUT_HEADER

from ._server import WAIT_S, open_client

pytestmark = [pytest.mark.cell, pytest.mark.asyncio(loop_scope="session")]

MAX_EXAMPLES = 40          # schema-valid requests per operation with inputs (9 of 15; the 6 without run 3 times)
DEADLINE_S = 1.0           # a request that takes a deadline gets at most this one, so a long decode ends as a timeout
CONTEXT_TIER = 128         # the fuzzed worker's: a decode is clamped to what is left of it
POOL = ("fz-pool-0", "fz-pool-1")   # sessions that exist at every request, so suffix, decode, ... get past 404
POOL_SNAPSHOT = "fz-pool.snap"      # a snapshot of POOL[0]: what a restore into a pool session reads
BASE = [504, 3458, 282, 4649, 314]  # what each pool session holds before every request
# A valid request may still be refused because of what the worker holds; each of these is typed and documented.
RUNTIME_OUTCOMES = {
    404: {"not_found"},   # the drawn session id or snapshot path names nothing
    409: {"conflict"},    # the session's state: another cache_salt, no tokens to decode from, a path in the way
    413: {"overflow"},    # the prompt passes the context tier or the KV budget
    504: {"timeout"},     # past DEADLINE_S (or the drawn, shorter deadline); partial output in details
}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, positive_data_acceptance]
CONFIG = {"checks": {"positive_data_acceptance": {"expected-statuses": ["2xx", *map(str, RUNTIME_OUTCOMES)]},
                     "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "504"]}}}


def _typed_outcome(resp: requests.Response) -> str | None:
    """None when the answer is a success or a typed runtime outcome; else what is wrong with it."""
    if resp.status_code == 200:
        return None
    try:
        err = schemas.ErrorResponse.model_validate(resp.json()).error
    except ValueError as e:
        return f"{resp.status_code} without a typed error body: {e}"
    if err.kind not in RUNTIME_OUTCOMES.get(resp.status_code, ()):
        return f"{resp.status_code} {err.kind}: {err.message}"
    return None


class Fuzz:
    """One run over every operation against the worker at ``url``: findings, and the statuses seen per operation."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = requests.Session()
        self.findings: list[str] = []
        self.seen: dict[str, dict[int, int]] = {}
        self.last = "(none yet)"     # the previous request and its answer: what broke the worker when reset() fails

    def reset(self) -> None:
        """The pool sessions hold BASE; every other session is closed, so the KV budget stays free."""
        for sid in POOL:
            r = self.http.post(f"{self.url}/v1/sessions/{sid}/prefix", json={"tokens": BASE})
            assert r.status_code == 200, f"{r.text}\nafter {self.last}"
        for entry in self.http.get(f"{self.url}/v1/sessions").json()["sessions"]:
            if entry["session_id"] not in POOL:
                self.http.delete(f"{self.url}/v1/sessions/{entry['session_id']}")

    def run(self) -> None:
        vocab = self.http.get(f"{self.url}/v1/capability").json()["model"]["vocab_size"]
        doc = openapi.for_model(json.loads(openapi.COMMITTED.read_text()), vocab)
        assert self.http.get(f"{self.url}/openapi.json").json() == doc   # what is fuzzed is what the worker serves
        self.reset()
        r = self.http.post(f"{self.url}/v1/sessions/{POOL[0]}/snapshot", json={"path": POOL_SNAPSHOT})
        assert r.status_code == 200, r.text
        schema = schemathesis.openapi.from_dict(doc, config=schemathesis.Config.from_dict(CONFIG))
        for result in schema.get_all_operations():
            self.operation(result.ok())

    def operation(self, op: Any) -> None:
        in_session = any(p.name == "session_id" for p in op.path_parameters)
        has_deadline = any(p.name == TIMEOUT_HEADER for p in op.headers)

        @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(), pick=st.integers(0, len(POOL)))
        def example(case: Any, pick: int) -> None:
            self.reset()
            if in_session and pick < len(POOL):     # a session that exists (else the drawn id: most likely none)
                case.path_parameters = {**case.path_parameters, "session_id": POOL[pick]}
                if op.path.endswith("/restore"):
                    case.body = {**case.body, "path": POOL_SNAPSHOT}
            if has_deadline:                        # the drawn deadline, or DEADLINE_S when that is shorter
                drawn = (case.headers or {}).get(TIMEOUT_HEADER)
                limit = min(float(drawn), DEADLINE_S) if drawn is not None else DEADLINE_S
                case.headers = {**(case.headers or {}), TIMEOUT_HEADER: repr(limit)}
            resp = case.call(base_url=self.url, session=self.http, timeout=WAIT_S)
            curl = case.as_curl_command(base_url=self.url)[:600]
            self.last = f"{curl} -> {resp.status_code} {resp.text[:300]}"
            counts = self.seen.setdefault(op.label, {})
            counts[resp.status_code] = counts.get(resp.status_code, 0) + 1
            problems = []
            try:
                case.validate_response(resp, checks=CHECKS)
            except FailureGroup as e:
                problems += [f"{f.title}: {f.message}"[:400] for f in e.exceptions]
            problem = _typed_outcome(resp)
            if problem:
                problems.append(problem)
            if problems:
                self.findings.append(f"{curl}\n    " + "\n    ".join(problems))

        example()


async def test_schema_valid_requests_are_served_or_typed_runtime_outcomes(make_engine, tmp_path):
    # Its own engine (the shared weights, its own sessions and KV budget): no session id the fuzzer draws can reach
    # another test's session, and 64 MiB (1456 fp32 tokens) holds the pool and any one drawn prompt.
    eng = make_engine(kv_mib=64, contextTier=CONTEXT_TIER)
    client = await open_client(eng, str(tmp_path))
    fuzz = Fuzz(str(client.make_url("")).rstrip("/"))
    try:
        await asyncio.to_thread(fuzz.run)   # synchronous HTTP off the loop, which serves the worker meanwhile
    except AssertionError as e:
        raise AssertionError(f"{e}\nengine ready: {eng.ready}, fatal: {eng.fatal_reason}") from None
    finally:
        await client.close()
    print("statuses per operation:", json.dumps(fuzz.seen, sort_keys=True))
    assert not fuzz.findings, f"{len(fuzz.findings)} answers break the document:\n" + "\n".join(fuzz.findings)
    assert eng.ready, eng.fatal_reason
