"""The container's entrypoint as a process: `python -m modeld_cell serve` on a free port, probes, one real exchange,
a clean SIGTERM. The cell spec handling that runs before any model loads is in tests/unit/test_cli.py (with CELL)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

import modeld_cell
from tests.unit.test_cli import CELL

pytestmark = pytest.mark.cell

REPO = Path(modeld_cell.__file__).resolve().parents[2]
START_S = 180.0  # safety net for start-up on a loaded 2-core machine; never a measured timing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_for(url: str, proc: subprocess.Popen, log: Path) -> dict:
    end = time.monotonic() + START_S
    while True:
        assert proc.poll() is None, f"worker exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            status, body = _http("GET", url)
            if status == 200:
                return body
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < end, f"{url} not 200 after {START_S}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def test_entrypoint_serves_a_cell(smollm2_path, tmp_path):
    cell = tmp_path / "cell.yaml"
    cell.write_text(yaml.safe_dump(CELL))
    port = _free_port()
    log = tmp_path / "worker.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "cellimage"), str(REPO / "api")]),
           "MODELD_CACHE_DIR": str(tmp_path / "cache"), "MODELD_THREADS": "1", "MODELD_LOG_LEVEL": "INFO"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "modeld_cell", "serve", "--cell", str(cell),
                                 "--host", "127.0.0.1", "--port", str(port), "--model", smollm2_path],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        assert _wait_for(base + "/healthz", proc, log) == {"status": "ok"}
        assert _wait_for(base + "/readyz", proc, log)["ready"] is True
        status, cap = _http("GET", base + "/v1/capability")
        assert status == 200 and cap["context_tier"] == 512
        status, out = _http("POST", base + "/v1/sessions/e2e/prefix", {"text": "The capital of France is"})
        assert status == 200, out
        status, out = _http("POST", base + "/v1/sessions/e2e/decode", {"max_tokens": 3})
        assert status == 200 and "Paris" in out["text"], out
        status, out = _http("POST", base + "/v1/sessions/e2e/decode", {"max_tokens": -1})
        assert status == 400 and out["error"]["details"]["field"] == "max_tokens"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()[-4000:]
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    requests = [x for x in lines if x.get("msg") == "request"]
    assert {"method": "POST", "path": "/v1/sessions/e2e/decode", "status": 200, "session": "e2e"}.items() <= \
        requests[-2].items()
    assert requests[-2]["tokens"] >= 1 and isinstance(requests[-2]["ms"], float)
    assert requests[-1]["error"] == "bad_request"


def _start_worker(cell: Path, smollm2_path: str, cache: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "cellimage"), str(REPO / "api")]),
           "MODELD_CACHE_DIR": str(cache), "MODELD_THREADS": "1", "MODELD_LOG_LEVEL": "INFO"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "modeld_cell", "serve", "--cell", str(cell),
                                 "--host", "127.0.0.1", "--port", str(port), "--model", smollm2_path],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def test_restore_into_another_worker_process(smollm2_path, tmp_path):
    """Snapshot in one worker process, restore over HTTP in a second process of the same cell (a shared volume): the
    second continues exactly as the first would have, in bf16; a corrupted file is refused and changes nothing."""
    from modeld_cell.kernels.dispatch import cpu_bf16_attention_error

    if (why := cpu_bf16_attention_error()) is not None:
        pytest.skip(f"this CPU's torch kernels have no bf16 attention, so the worker refuses bf16 weights: {why}")
    spec = {**CELL["spec"], "profile": {"weights": "bf16", "kv": "bf16", "attention": "dense", "prefixReuse": True}}
    cell = tmp_path / "cell.yaml"
    cell.write_text(yaml.safe_dump({**CELL, "spec": spec}))
    cache = tmp_path / "cache"                      # both processes mount the same snapshot directory
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = []
    try:
        for log in logs:
            procs.append(_start_worker(cell, smollm2_path, cache, log))
        (pa, a), (pb, b) = procs
        for (p, url), log in zip(procs, logs, strict=True):
            assert _wait_for(url + "/readyz", p, log)["ready"] is True
        messages = [{"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": "List three uses of a lighthouse, one line each."}]
        status, out = _http("POST", a + "/v1/sessions/s/prefix", {"messages": messages})
        assert status == 200, out
        status, first = _http("POST", a + "/v1/sessions/s/decode", {"max_tokens": 12})
        assert status == 200, first
        status, snap = _http("POST", a + "/v1/sessions/s/snapshot", {"path": "s.snap"})
        assert status == 200 and snap["snapshot"]["session_tokens"] > 0, snap
        status, want = _http("POST", a + "/v1/sessions/s/decode", {"max_tokens": 16})   # A goes on from the snapshot
        assert status == 200, want

        status, restored = _http("POST", b + "/v1/sessions/r/restore", {"path": "s.snap"})
        assert status == 200, restored
        assert restored["trace"]["reuse"]["tokens_restored"] == snap["snapshot"]["kv_tokens"]
        status, got = _http("POST", b + "/v1/sessions/r/decode", {"max_tokens": 16})
        assert status == 200, got
        assert got["tokens"] == want["tokens"] and got["text"] == want["text"]

        # a damaged copy is refused with a clear error; the session B holds is untouched
        damaged = bytearray((cache / "snapshots" / "s.snap").read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        (cache / "snapshots" / "bad.snap").write_bytes(bytes(damaged))
        _, before = _http("GET", b + "/v1/sessions/r")
        status, err = _http("POST", b + "/v1/sessions/r/restore", {"path": "bad.snap"})
        assert status == 400 and err["error"]["kind"] == "bad_request" and "checksum" in err["error"]["message"], err
        _, after = _http("GET", b + "/v1/sessions/r")
        assert after["tokens"] == before["tokens"]
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
        for p, _ in procs:
            p.wait(timeout=60)


def test_a_refused_spec_keeps_the_worker_up_and_says_why(smollm2_path, tmp_path):
    """A spec the engine refuses at start (here model.digest naming other weights: deterministic on any CPU) does not
    end the process: /healthz stays 200, so the pod is not restarted into the same refusal, and /readyz and every
    engine route answer the typed refusal naming the field, which the operator copies into the Cell's status."""
    spec = {**CELL["spec"], "model": {**CELL["spec"]["model"], "digest": "sha256:" + "0" * 64}}
    cell = tmp_path / "cell.yaml"
    cell.write_text(yaml.safe_dump({**CELL, "spec": spec}))
    log = tmp_path / "worker.log"
    proc, url = _start_worker(cell, smollm2_path, tmp_path / "cache", log)
    try:
        _wait_for(f"{url}/healthz", proc, log)
        end = time.monotonic() + START_S
        while (got := _http("GET", f"{url}/readyz"))[0] == 503:      # not_ready while the model loads
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-4000:]
            time.sleep(0.2)
        status, body = got
        err = body["error"]
        assert status == 400 and err["kind"] == "bad_request", body
        assert err["details"]["refused"] is True and err["details"]["field"] == "model.digest", body
        assert "refused its cell spec at start" in err["message"] and "does not match the loaded weights" in err["message"]
        assert _http("POST", f"{url}/v1/sessions/s/prefix", {"text": "hi"})[1]["error"]["details"]["refused"]
        assert _http("GET", f"{url}/healthz")[0] == 200 and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_drains_the_requests_in_flight(smollm2_path, tmp_path):
    """SIGTERM while a decode streams: the decode runs to its done event, a new request meanwhile is refused (503
    not_ready, typed, or the listener is closed), and the process exits 0."""
    import http.client

    cell = tmp_path / "cell.yaml"
    cell.write_text(yaml.safe_dump(CELL))
    proc, base = _start_worker(cell, smollm2_path, tmp_path / "cache", tmp_path / "worker.log")
    try:
        assert _wait_for(base + "/readyz", proc, tmp_path / "worker.log")["ready"] is True
        assert _http("POST", base + "/v1/sessions/d/prefix", {"text": "Once upon a time, in a quiet harbour town,"})[0] \
            == 200
        req = urllib.request.Request(base + "/v1/sessions/d/decode", json.dumps(
            {"max_tokens": 48, "stop_token_ids": [], "stream": True}).encode(), {"Content-Type": "application/json"})
        stream = urllib.request.urlopen(req, timeout=120)
        while not stream.readline().startswith(b"event: token"):
            pass
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            status, body = _http("POST", base + "/v1/sessions/e/prefix", {"text": "hello"})
            assert status == 503 and body["error"]["kind"] == "not_ready" and "shutting down" in \
                body["error"]["message"], body
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
            pass                                         # the listener is already closed: also refused
        rest = stream.read()
        assert b"event: done" in rest, rest[-500:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert "draining" in (tmp_path / "worker.log").read_text()
