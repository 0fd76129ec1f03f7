"""Replicated weights + sharded KV on the real SmolLM2 weights, across real gloo ranks started by torch's launcher,
against one rank's torch path: a prompt across page and shard boundaries, a chunk after a cached past (the prefill
plan: every chunk's rows see the earlier shards through the exact merge), then greedy decode.

Both sides run the same stated prefix of the model (its first 2 layers) to keep CI quick; the mechanism per layer is
the same at 30. Bound: fp32 logits within 1e-4 (the same sums in another order; measured ~3e-5)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cell

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_ABS = 1e-4


@pytest.mark.parametrize("world, kv, steps", [(2, "fp32", 256), (3, "int8", 64)], ids=["2-ranks-fp32", "3-ranks-int8"])
def test_sharded_kv_across_ranks_equals_one_rank(smollm2_path, tmp_path, world, kv, steps):
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "cellimage"), str(ROOT / "api"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                        str(ROOT / "tests/dist/sharded_model_rank.py"), smollm2_path, "2", kv, str(steps), str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["world"] == world and len(res["tokens"]) == steps
    assert res["tokens"] == res["reference_tokens"]
    assert res["max_abs_logits"] <= MAX_ABS, res["max_abs_logits"]


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_lost_rank_is_a_typed_error_within_the_collective_timeout(smollm2_path, tmp_path, mode):
    """A rank that dies (or stops answering) mid-decode: the other's next collective raises RankLost (which the
    engine turns into Fatal and not-ready) instead of hanging; a hung peer is given up after the group's timeout."""
    timeout_s = 6
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "cellimage"), str(ROOT / "api"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(ROOT / "tests/dist/sharded_rank_lost.py"), smollm2_path, str(timeout_s), mode, str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), (r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["error"] == "RankLost" and res["steps"] == 3, res
    # bounded by the group's timeout (plus scheduling slack), never a hang
    assert res["seconds"] <= timeout_s + 10, res
