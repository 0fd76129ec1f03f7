"""One rank of the multi-rank engine check (tests/cell/test_sharded_kv.py starts it):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist/sharded_engine_rank.py GGUF SHAPE KV STEPS OUT

The whole session contract on a cell of N CPU ranks of runtime.parallelism SHAPE (sharded-kv, tensor or pipeline; the first
LAYERS layers of SmolLM2, KV precision KV), built the way the worker builds it: rank 0 ``Engine.from_cell`` (the
engine over the pool of every rank's blocks, driving), the others ``loader.load_follower``. Rank 0 runs the same script on a single-rank engine of the same weights and writes both
sides' greedy tokens and next-token logits at each checkpoint:

    a prompt across page and shard boundaries; STEPS greedy tokens; a suffix after that cached past; a branch (a
    second session sharing a prefix: prefix-cache blocks plus a copy-on-write block) decoded in one batch with the
    first; a snapshot of the sharded session restored into a third session, which continues.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch

from modeld_cell.engine import Engine, EngineSettings, SamplingParams
from modeld_cell.loader import load_follower
from modeld_cell.models.fetch import SMOLLM2_REF

LAYERS = 2


def spec(kv: str, ranks: int, shape: str = "single") -> dict:
    runtime = {"backend": "torch", "parallelism": shape, "ranks": ranks} if ranks > 1 else {"backend": "torch"}
    return {"runtime": runtime, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": "fp32", "kv": kv, "attention": "dense", "prefixReuse": True},
            "contextTier": 2048, "kvMemoryMiB": 16}


async def greedy(eng: Engine, sid: str, n: int) -> list[int]:
    return [ev.token_id async for ev in eng.decode(sid, SamplingParams(), n) if not ev.done]


async def script(eng: Engine, steps: int, snap: str) -> dict:
    """The contract, step by step; returns tokens per step and the next-token logits at each checkpoint."""
    vocab = eng.vocab_size
    prompt = [(i * 7919 + 11) % vocab for i in range(57)]               # crosses pages (16) and shards
    out: dict = {"tokens": {}, "logits": {}}

    def mark(name: str, sid: str) -> None:
        out["logits"][name] = eng.next_token_logits(sid)

    await eng.ensure_prefix("a", prompt)
    mark("prefix", "a")
    out["tokens"]["decode"] = await greedy(eng, "a", steps)
    await eng.prefill_suffix("a", [(i * 104729 + 3) % vocab for i in range(23)])
    mark("suffix", "a")
    tr = await eng.ensure_prefix("b", prompt[:45] + [(i * 31 + 5) % vocab for i in range(10)])   # 2 blocks + 13 tokens
    out["branch_reuse"] = {"tokens_reused": tr.tokens_reused, "source": tr.reuse.get("source"),
                           "blocks_copied": tr.reuse.get("blocks_copied")}
    mark("branch", "b")
    a, b = await asyncio.gather(greedy(eng, "a", 24), greedy(eng, "b", 24))       # one batched decode
    out["tokens"]["batched_a"], out["tokens"]["batched_b"] = a, b
    await eng.snapshot("a", snap)
    await eng.restore("c", snap)
    mark("restored", "c")
    out["tokens"]["restored"] = await greedy(eng, "c", 24)
    out["session_tokens"] = len(eng.session_tokens("c"))
    return out


def diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """Max abs difference of two next-token logits; None when neither is known (the last generated token has not
    run yet, e.g. right after a restore); inf when only one is."""
    if a is None or b is None:
        return None if a is None and b is None else float("inf")
    return float((a - b).abs().max())


def main() -> None:
    path, shape, kv, steps, out_path = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    world = int(os.environ["WORLD_SIZE"])
    st = EngineSettings(threads=1, collective_timeout_s=120)
    if int(os.environ["RANK"]) != 0:
        load_follower(spec(kv, world, shape), path, st, layers=LAYERS)          # returns when rank 0 says stop
        return
    eng = Engine.from_cell(spec(kv, world, shape), model_path=path, settings=st, layers=LAYERS, gate=False)
    ref = Engine.from_cell(spec(kv, 1), model_path=path, settings=EngineSettings(threads=1), layers=LAYERS,
                           gate=False)
    try:
        got = asyncio.run(script(eng, steps, out_path + ".sharded.snap"))
        want = asyncio.run(script(ref, steps, out_path + ".ref.snap"))
        cap = eng.capability()
        # a snapshot of the multi-rank session is refused by the single-rank engine (the merge's order is in the identity)
        try:
            asyncio.run(ref.restore("x", out_path + ".sharded.snap"))
            foreign = "accepted"
        except Exception as e:       # noqa: BLE001  (the test reads the kind)
            foreign = getattr(e, "kind", type(e).__name__) + ": " + str(e)[:200]
    finally:
        eng.shutdown()               # stops the followers
        ref.shutdown()
    res = {"command": "python -m torch.distributed.run --standalone --nproc-per-node " + str(world) + " "
                      + " ".join(sys.argv), "world": world, "shape": shape, "kv": kv, "tokens": got["tokens"], "reference_tokens": want["tokens"],
           "branch_reuse": got["branch_reuse"], "reference_branch_reuse": want["branch_reuse"],
           "session_tokens": got["session_tokens"], "foreign_snapshot": foreign,
           "max_abs_logits": {k: diff(got["logits"][k], want["logits"][k]) for k in got["logits"]},
           "parallel": cap.get("parallel"), "kv_report": cap["kv"], "runner": cap["runtime"]["runner"]}
    with open(out_path, "w") as f:
        json.dump(res, f, default=str)
    assert not torch.distributed.is_initialized()      # eng.shutdown() left the groups (parallel/ranks.leave)


if __name__ == "__main__":
    main()
