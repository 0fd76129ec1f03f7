"""Replicated weights + sharded KV, decode: each rank attends over its round-robin shard of the paged KV and the
partial states merge exactly across ranks (kernels/merge/sharded.py), against the decode over the whole cache.
The ranks are real processes over gloo, started by torch's own launcher (torch.distributed.run)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from modeld_cell.kernels.merge import sharded

pytestmark = pytest.mark.kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]
# fp32: the merged partials are the same sums as one pass over all keys, in another order; measured ~1e-7.
MAX_ABS = 1e-5


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 47, 48, 49, 100])
def test_the_shards_partition_every_token(world, n):
    lens = [sharded.local_tokens(n, 16, r, world) for r in range(world)]
    assert sum(lens) == n
    blocks = sorted(i for r in range(world) for i in sharded.local_block_indices(-(-n // 16), r, world))
    assert blocks == list(range(-(-n // 16)))
    assert all(sharded.owner(i, world) == i % world for i in blocks)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_decode_across_gloo_ranks_equals_one_rank(tmp_path, world):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "cellimage"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                        str(ROOT / "tests/dist/sharded_decode_rank.py"), str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads(out.read_text())
    assert res["world"] == world and res["identical_on_every_rank"] is True
    assert res["max_abs_out"] <= MAX_ABS and res["max_abs_lse"] <= MAX_ABS, res
    # the one-token sequence leaves every rank but 0 with an empty shard: merged safely (no NaN above)
    assert res["local_lens_rank0"][0] == 1


@pytest.mark.parametrize("case", ["prefill-after-past", "rows-that-see-nothing", "decode", "empty-shard"])
def test_the_cpu_flash_partial_attention_equals_the_reference(case):
    """partial_attention_flash (torch's CPU flash kernel, which returns the LSE) against the plain-torch reference,
    fp32: the same out and natural-log LSE where a row sees keys of the shard, 0 and -inf where it sees none."""
    import torch

    g = torch.Generator().manual_seed(7)
    hq, hkv, d = 9, 3, 64
    shard = torch.cat([torch.arange(16, 32), torch.arange(48, 64), torch.arange(80, 90)])     # a rank's blocks
    q_pos = {"prefill-after-past": torch.arange(60, 97), "rows-that-see-nothing": torch.arange(0, 37),
             "decode": torch.tensor([89]), "empty-shard": torch.arange(0, 5)}[case]
    k_pos = shard[:0] if case == "empty-shard" else shard
    q = torch.randn(len(q_pos), hq, d, generator=g)
    k, v = torch.randn(len(k_pos), hkv, d, generator=g), torch.randn(len(k_pos), hkv, d, generator=g)
    want_out, want_lse = sharded.partial_attention(q, k, v, q_pos, k_pos, d ** -0.5)
    out, lse = sharded.partial_attention_flash(q, k, v, q_pos, k_pos, d ** -0.5)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert float((out - want_out).abs().max()) <= MAX_ABS
    if fin.any():
        assert float((lse[fin] - want_lse[fin]).abs().max()) <= MAX_ABS
