"""Session continuity across the loss of the worker process (MODELD_SESSION_STORE, journal.py): a worker killed with
SIGKILL mid-decode, a new process of the same cell on the same store; the session continues from its last committed
turn, the in-flight decode is lost (the stream broke; nothing of it was committed), and greedy output equals that of
a session that never died. Plus what the store refuses: another cell's state, and closing a lost session."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.unit.test_cli import CELL

from .test_server_entrypoint import REPO, _free_port, _http, _wait_for

pytestmark = pytest.mark.cell

MESSAGES = [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": "Name three uses of a lighthouse, one line each."}]


def _worker(cell: Path, model: str, store: Path, log: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    port = port or _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "cellimage"), str(REPO / "api")]),
           "MODELD_CACHE_DIR": str(store.parent / "cache"), "MODELD_THREADS": "1", "MODELD_LOG_LEVEL": "INFO",
           "MODELD_SESSION_STORE": str(store)}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "modeld_cell", "serve", "--cell", str(cell), "--host",
                                 "127.0.0.1", "--port", str(port), "--model", model], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    assert _wait_for(url + "/readyz", proc, log)["ready"] is True
    return proc, url


def _turns(url: str, sid: str) -> list[list[int]]:
    """Prefix, decode 8, a user turn as suffix, decode 8, a user turn asking for a long answer: the committed part
    of the exchange."""
    out = []
    assert _http("POST", f"{url}/v1/sessions/{sid}/prefix", {"messages": MESSAGES})[0] == 200
    out.append(_http("POST", f"{url}/v1/sessions/{sid}/decode", {"max_tokens": 8})[1]["tokens"])
    status, body = _http("POST", f"{url}/v1/sessions/{sid}/suffix",
                         {"messages": [{"role": "user", "content": "And one more?"}]})
    assert status == 200, body
    out.append(_http("POST", f"{url}/v1/sessions/{sid}/decode", {"max_tokens": 8})[1]["tokens"])
    status, body = _http("POST", f"{url}/v1/sessions/{sid}/suffix", {"messages": [
        {"role": "user", "content": "Now write a numbered list of forty facts about lighthouses."}]})
    assert status == 200, body
    return out


def test_a_session_survives_kill_9_of_its_worker_mid_decode(smollm2_path, tmp_path):
    cell = tmp_path / "cell.yaml"
    cell.write_text(yaml.safe_dump(CELL))
    store = tmp_path / "store"
    proc, url = _worker(cell, smollm2_path, store, tmp_path / "a.log")
    procs = [proc]
    try:
        # the reference: a session that never dies, on the same worker
        ref = _turns(url, "ref")
        ref_next = _http("POST", f"{url}/v1/sessions/ref/decode", {"max_tokens": 12})[1]["tokens"]
        got = _turns(url, "s")
        assert got == ref
        _, held = _http("GET", f"{url}/v1/sessions/s")
        # a long decode in flight, streamed; the worker is killed once the first tokens arrived
        req = urllib.request.Request(f"{url}/v1/sessions/s/decode", json.dumps(
            {"max_tokens": 200, "stream": True}).encode(), {"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=60)
        seen = 0
        while seen < 1:
            line = resp.readline()
            assert line, "the stream ended before the kill"
            seen += line.startswith(b"event: token")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        rest = b""
        try:                                       # the in-flight decode is lost: its stream breaks, no "done"
            rest = resp.read()
        except (OSError, http.client.HTTPException):
            pass
        assert b"event: done" not in rest
        port = int(url.rsplit(":", 1)[1])
        proc, url = _worker(cell, smollm2_path, store, tmp_path / "b.log", port=port)   # the pod's restart
        procs.append(proc)
        # the next call on the same id continues from the last committed turn, exactly
        status, out = _http("POST", f"{url}/v1/sessions/s/decode", {"max_tokens": 12})
        assert status == 200, out
        restored = out["trace"]["restored"]
        assert restored["tokens_restored"] == len(held["tokens"])
        assert out["tokens"] == ref_next
        # the committed turns' accounting is carried over, the last request (a suffix) included (the recovery's
        # recompute is the worker's, not the client's)
        totals = out["trace"]["totals"]
        assert totals["completion_tokens"] == sum(map(len, got)) + len(out["tokens"])
        assert totals["prompt_tokens"] == held["session"]["totals"]["prompt_tokens"] + out["trace"]["prompt_tokens"]
        # recovered once: the next request is served from the session it holds
        status, out = _http("GET", f"{url}/v1/sessions/s")
        assert status == 200 and "restored" not in json.dumps(out)
        # the recovery wrote nothing (the store held exactly that state): one commit, the decode's
        cap = _http("GET", f"{url}/v1/capability")[1]
        assert cap["reuse"]["session_store"]["commits"] == 1
        # closing a session drops its stored state: after another loss it is gone, not restored
        assert _http("DELETE", f"{url}/v1/sessions/s")[0] == 200
        assert _http("POST", f"{url}/v1/sessions/s/decode", {"max_tokens": 2})[0] == 404
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)


def test_a_stored_session_of_another_cell_is_reported_lost_not_continued(smollm2_path, tmp_path):
    """State committed by a cell with another cache identity (here bf16 KV vs fp32) would not continue the same
    computation: the session is reported lost with that reason, and closing it drops the stored state."""
    store = tmp_path / "store"
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(CELL))
    b.write_text(yaml.safe_dump({**CELL, "spec": {**CELL["spec"], "profile": {**CELL["spec"].get("profile", {}),
                                                                              "kv": "fp16"}}}))
    proc, url = _worker(a, smollm2_path, store, tmp_path / "a.log")
    try:
        assert _http("POST", f"{url}/v1/sessions/x/prefix", {"text": "The capital of France is"})[0] == 200
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    proc, url = _worker(b, smollm2_path, store, tmp_path / "b.log")
    try:
        status, out = _http("POST", f"{url}/v1/sessions/x/decode", {"max_tokens": 2})
        assert status == 404 and "another cache identity" in out["error"]["message"], out
        status, out = _http("POST", f"{url}/v1/sessions/x/prefix", {"text": "Hello"})   # a new session, said so
        assert status == 200 and "another cache identity" in out["trace"]["restored"]["lost"], out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
