"""The local pod runner stops its workers together and for certain: SIGTERM to every process group at once, SIGKILL
to those still alive after one grace period (a worker that outlived its cluster held a pod IP the next cluster
handed out again)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _podrunner():
    spec = importlib.util.spec_from_file_location("podrunner", ROOT / "hack" / "podrunner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["podrunner"] = module          # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _spawn(pr, tmp_path: Path, name: str, ignores_term: bool):
    """A process in its own session (as the runner starts pods) that records the SIGTERM it gets in a file, and
    either ignores it or exits on it. It writes 'up' once its trap is set."""
    mark = tmp_path / name
    handler = f"echo term >> {mark}" if ignores_term else f"echo term >> {mark}; exit 0"
    script = f"trap '{handler}' TERM; echo up > {mark}; while true; do sleep 0.05; done"
    run = pr.Running(name, ["bash", "-c", script], {}, tmp_path / f"{name}.log")
    run.proc = subprocess.Popen(run.argv, start_new_session=True)
    deadline = time.monotonic() + 30
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return run, mark


def test_stop_all_terms_every_group_at_once_then_kills_the_ones_that_stay(tmp_path):
    pr = _podrunner()
    stubborn = [_spawn(pr, tmp_path, f"stubborn{i}", ignores_term=True) for i in range(3)]
    polite = _spawn(pr, tmp_path, "polite", ignores_term=False)
    runs = [r for r, _ in stubborn] + [polite[0]]
    grace = 2.0
    t0 = time.monotonic()
    pr.Runner.stop_all(runs, grace=grace)
    took = time.monotonic() - t0
    assert all(r.proc.poll() is not None and r.stopped for r in runs)
    assert all("term" in mark.read_text() for _, mark in [*stubborn, polite])   # each was asked first
    assert [r.proc.returncode for r, _ in stubborn] == [-9, -9, -9]              # then killed
    assert polite[0].proc.returncode == 0                                         # it left on SIGTERM
    # one grace period for all of them, not one each (3 stubborn processes stopped one by one take 3 x grace)
    assert took < 2 * grace, took


def test_stop_all_of_processes_already_gone_returns_at_once(tmp_path):
    pr = _podrunner()
    run, _ = _spawn(pr, tmp_path, "gone", ignores_term=False)
    run.proc.terminate()
    run.proc.wait()
    t0 = time.monotonic()
    pr.Runner.stop_all([run, pr.Running("never-started", ["true"], {}, tmp_path / "x.log")], grace=30.0)
    assert time.monotonic() - t0 < 30.0 and run.stopped


def test_a_runner_killed_outright_takes_its_pods_processes_down(tmp_path):
    """SIGKILL gives the runner no chance to stop anything; the kernel's parent-death signal still sends each pod's
    process SIGTERM, so none keeps its pod IP after the runner is gone."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    mark = tmp_path / "pod"
    script = f"trap 'echo term >> {mark}; exit 0' TERM; echo $$ > {mark}.pid; echo up > {mark}; while true; do sleep 0.05; done"
    runner_code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('podrunner', {str(ROOT / 'hack' / 'podrunner.py')!r})\n"
        "pr = importlib.util.module_from_spec(spec); sys.modules['podrunner'] = pr; spec.loader.exec_module(pr)\n"
        f"run = pr.Running('ns/pod', ['bash', '-c', {script!r}], {{'PATH': '/usr/bin:/bin'}}, pr.Path({str(tmp_path / 'pod.log')!r}))\n"
        f"pr.Runner(pr.Path({str(tmp_path)!r})).spawn(run)\n"
        "time.sleep(600)\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", runner_code])
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.read_text().strip() == "up"
        pid = int((tmp_path / "pod.pid").read_text())
        runner.kill()
        runner.wait()
        deadline = time.monotonic() + 30
        while "term" not in mark.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "term" in mark.read_text()
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if runner.poll() is None:
            runner.kill()
        if (tmp_path / "pod.pid").exists():       # a failed run must not leave its pod's process behind
            try:
                os.kill(int((tmp_path / "pod.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
