"""A data-parallel cell on this machine: the pod's command (placement.worker_command) starts its copies under torch's
launcher, each a single-rank engine on its own port (spec.port + copy), serving its own sessions; a snapshot moves a
session between copies (the same engine identity); a copy that dies takes the pod down with it (the launcher stops the
others and exits non-zero, so the container restarts them together)."""

from __future__ import annotations

import os

import pytest

from tests.cell.test_sharded_kv import _launch, _rank_pids

pytestmark = pytest.mark.cell


def test_a_data_parallel_cell_serves_independent_sessions_on_its_copies(smollm2_path, tmp_path):
    from tests.cell.test_server_entrypoint import _http, _wait_for

    proc, base, log = _launch(tmp_path, smollm2_path, {"backend": "torch", "parallelism": "data", "ranks": 2})
    port = int(base.rsplit(":", 1)[1])
    copies = [base, f"http://127.0.0.1:{port + 1}"]
    try:
        for url in copies:
            assert _wait_for(url + "/readyz", proc, log)["ready"] is True
        caps = [_http("GET", url + "/v1/capability")[1] for url in copies]
        for i, cap in enumerate(caps):
            par = cap["parallel"]
            assert par["shape"] == "data" and par["copies"] == 2 and par["copy"] == i, par
            assert cap["runtime"]["runner"] == "torch" and cap["runtime"]["threads"] >= 1, cap["runtime"]
        # copies are the same cell: one identity (snapshots move between them), one KV budget each
        assert caps[0]["reuse"]["identity_root"] == caps[1]["reuse"]["identity_root"]
        assert caps[0]["parallel"]["max_tokens_per_copy"] == caps[1]["parallel"]["max_tokens_per_copy"] > 0

        # independent sessions: one on each copy, and neither copy holds the other's
        for url, text in zip(copies, ("The capital of France is", "The largest planet is"), strict=True):
            status, out = _http("POST", url + "/v1/sessions/s/prefix", {"text": text})
            assert status == 200, out
        status, a = _http("POST", copies[0] + "/v1/sessions/s/decode", {"max_tokens": 3})
        assert status == 200 and "Paris" in a["text"], a
        status, b = _http("POST", copies[1] + "/v1/sessions/s/decode", {"max_tokens": 3})
        assert status == 200 and "Paris" not in b["text"], b
        status, only = _http("POST", copies[1] + "/v1/sessions/t/decode", {"max_tokens": 1})
        assert status == 404 and only["error"]["kind"] == "not_found", only
        _http("POST", copies[0] + "/v1/sessions/t/prefix", {"text": "Hello"})
        for url, want in zip(copies, (["s", "t"], ["s"]), strict=True):
            status, listed = _http("GET", url + "/v1/sessions")
            assert sorted(x["session_id"] for x in listed["sessions"]) == want, listed

        # a session moves between copies through a snapshot (their snapshot directory is the pod's) and goes on
        # exactly as it would have
        status, snap = _http("POST", copies[0] + "/v1/sessions/s/snapshot", {"path": "s.snap"})
        assert status == 200, snap
        status, want = _http("POST", copies[0] + "/v1/sessions/s/decode", {"max_tokens": 8})
        assert status == 200, want
        status, restored = _http("POST", copies[1] + "/v1/sessions/moved/restore", {"path": "s.snap"})
        assert status == 200, restored
        status, got = _http("POST", copies[1] + "/v1/sessions/moved/decode", {"max_tokens": 8})
        assert status == 200 and got["tokens"] == want["tokens"], (got, want)

        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], 9)
        assert proc.wait(timeout=60) != 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
