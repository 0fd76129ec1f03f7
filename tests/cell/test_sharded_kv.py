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
