"""A short bounded load on a real worker (benchmarks/load_worker.py): concurrent sessions mixing every session
operation past the KV budget, then SIGTERM with decodes in flight. Asserts the mechanisms, not speed: every error is
typed and no 5xx is anything but a timeout or draining; the budget was reached and an overflow changed nothing; the
planted secret appears in no other response or session; the KV in use never passed the budget; SIGTERM let the
decodes in flight finish and the worker exit 0. The figures of a long run are in docs/worker.md "Load"."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.cell
ROOT = Path(__file__).resolve().parents[2]


def _load_module():
    spec = importlib.util.spec_from_file_location("load_worker", ROOT / "benchmarks" / "load_worker.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_bounded_load_past_the_kv_budget_keeps_every_requirement(tmp_path):
    load = _load_module()
    # 16 MiB of bf16 KV is 45 blocks (720 tokens): six clients' first prompts alone pass it
    out = load.run(clients=6, duration=8.0, kv_mib=16, tier=2048, seed=3, threads=1, workdir=tmp_path)
    assert out["violation_counts"] == {}, out["violations"]
    assert out["errors_by_kind"].get("overflow", 0) >= 1, out["statuses"]        # the budget was reached
    assert out["kv_blocks_used_max"] <= out["kv_blocks"]
    assert out["sigterm"]["exit"] == 0 and out["sigterm"]["in_flight"], out["sigterm"]
    assert sum(op["n"] for op in out["ops"].values()) == out["requests"]
