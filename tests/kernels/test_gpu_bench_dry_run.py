"""``hack/gpu-bench.sh --dry-run`` runs the script's steps on the CPU under the Triton interpreter at tiny shapes, so
the script that device time depends on cannot rot: every step must exit 0 and write its file."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script runs for real, not dry")]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dry_run_runs_every_step(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    r = subprocess.run(["bash", "hack/gpu-bench.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=500)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert set(steps) == {"env", "kernel-tests", "kernels", "engine", "nvml"} and all(s["rc"] == 0 for s in steps.values()), steps
    assert json.loads((tmp_path / "env.json").read_text())["dry_run"] is True
    assert "passed" in (tmp_path / "kernels-tests.txt").read_text()
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert any(row["provider"].startswith("triton") for row in rows), rows
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert engine["startup_check"]["device"] == "cpu" and engine["kernels"]["calls"]["paged_prefill"] > 0
    assert all(c["greedy_tokens_identical"] == c["of"] for c in engine["contexts"].values()), engine["contexts"]


def test_bad_arguments_are_refused():
    r = subprocess.run(["bash", "hack/gpu-bench.sh", "--wet"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
