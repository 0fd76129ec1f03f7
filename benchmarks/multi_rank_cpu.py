"""A multi-rank cell (--shape sharded-kv, tensor or pipeline) vs one rank at the same per-rank KV budget, on this
CPU, through the Engine the worker serves.

Two runs of the real SmolLM2-135M-Instruct (weights and KV as --weights / --kv), each a fresh process tree:
  * one rank: ``Engine.from_cell`` of a single-rank CPU cell with --kv-mib MiB of KV, MODELD_THREADS = all cores;
  * N ranks: ``python -m torch.distributed.run --standalone --nproc-per-node N`` of this script, a cell of
    runtime.parallelism --shape over N CPU ranks (gloo) with --kv-mib MiB of KV per rank, the cores split between
    the ranks (at least one thread each: more ranks than cores oversubscribe them, and the JSON says so).
At each --contexts length (real text, a cold session): the prompt is prefilled and --decode-tokens greedy tokens
decoded; recorded are first output (prefill + first token, ms), decode ms/token (p50), and for the multi-rank cell
the time rank 0 spent in collectives per decode step (its share of the step; a pipeline's transfers, with its wait
for the other ranks' compute apart as the bubble). A length a run cannot hold is
recorded as its Overflow. Writes JSON (--out) with the command, the machine and both runs.

    PYTHONPATH=cellimage:api .venv/bin/python benchmarks/multi_rank_cpu.py --shape sharded-kv --ranks 2 \
        --out docs/bench/DATE/multi_rank_cpu_sharded_kv.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spec(a: argparse.Namespace, ranks: int) -> dict:
    from modeld_cell.models.fetch import SMOLLM2_REF

    runtime = {"backend": "torch", "parallelism": a.shape, "ranks": ranks} if ranks > 1 else {"backend": "torch"}
    return {"runtime": runtime, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": a.weights, "kv": a.kv, "prefixReuse": False},
            "contextTier": a.tier, "kvMemoryMiB": a.kv_mib}


async def measure(eng, a: argparse.Namespace) -> dict:
    from benchmarks.cell_cpu import corpus_text

    from modeld_cell import errors
    from modeld_cell.engine import SamplingParams

    ids = eng.tokenizer.encode(corpus_text())
    out: dict = {}
    await eng.ensure_prefix("warm", ids[:128])
    async for _ in eng.decode("warm", SamplingParams(), 2):
        pass
    eng.close_session("warm")
    for n in (int(x) for x in a.contexts.split(",")):
        runner = eng.runner
        before = (dict(getattr(runner, "collective_s", {})), dict(getattr(runner, "forwards", {})),
                  dict(getattr(runner, "bubble_s", {})))
        t0 = time.perf_counter()
        try:
            await eng.ensure_prefix(f"s{n}", ids[:n])
        except errors.Overflow as e:
            out[n] = {"served": False, "error": f"overflow: {e.message}"}
            continue
        first, per_tok = None, []
        async for ev in eng.decode(f"s{n}", SamplingParams(), a.decode_tokens, stop_token_ids=[]):
            if first is None:
                first = (time.perf_counter() - t0) * 1e3
            if ev.done:
                per_tok = ev.trace.decode_ms_per_token
        row = {"served": True, "first_output_ms": round(first or 0.0, 1),
               "decode_ms_p50": round(statistics.median(per_tok), 2) if per_tok else None}
        if before[0]:
            steps = runner.forwards["decode"] - before[1]["decode"]
            coll = (runner.collective_s["decode"] - before[0]["decode"]) * 1e3 / max(1, steps)
            row["collective_ms_per_decode_step"] = round(coll, 2)
            if row["decode_ms_p50"]:
                row["collective_share_of_decode"] = round(coll / row["decode_ms_p50"], 3)
            if before[2]:                # pipeline: rank 0's wait for the other ranks' compute, apart from the transfers
                bubble = (runner.bubble_s["decode"] - before[2]["decode"]) * 1e3 / max(1, steps)
                row["bubble_ms_per_decode_step"] = round(bubble, 2)
        eng.close_session(f"s{n}")
        out[n] = row
    return out


def run_here(a: argparse.Namespace) -> None:
    """One run in this process tree (the single rank, or one of the launcher's ranks); rank 0 writes --result."""
    import torch

    from modeld_cell.config import EngineSettings
    from modeld_cell.engine import Engine
    from modeld_cell.loader import load_follower

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    st = EngineSettings.from_env()
    st.threads = max(1, (os.cpu_count() or 1) // ranks)
    if os.environ.get("RANK", "0") != "0":
        load_follower(spec(a, ranks), None, st)
        return
    t = time.perf_counter()
    eng = Engine.from_cell(spec(a, ranks), settings=st)
    load_s = time.perf_counter() - t
    try:
        rows = asyncio.run(measure(eng, a))
        cap = eng.capability()
    finally:
        eng.shutdown()
    Path(a.result).write_text(json.dumps({"ranks": ranks, "threads_per_rank": st.threads, "load_s": round(load_s, 1),
                                          "torch": torch.__version__, "kv": cap["kv"], "parallel": cap["parallel"],
                                          "contexts": rows}, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="sharded-kv", choices=["sharded-kv", "tensor", "pipeline"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--weights", default="q4_1")
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--kv-mib", type=int, default=100, help="KV budget per rank (MiB); the single rank gets the same")
    ap.add_argument("--tier", type=int, default=8192)
    ap.add_argument("--contexts", default="4000,8000")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", default="_out/multi_rank_cpu.json")
    ap.add_argument("--result", help=argparse.SUPPRESS)          # internal: one run's result file
    a = ap.parse_args()
    if a.result:
        run_here(a)
        return
    from modeld_cell.profile_gate import hardware

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "cellimage"), str(ROOT / "api")])}
    env.pop("MODELD_THREADS", None)
    passthrough = ["--shape", a.shape, "--weights", a.weights, "--kv", a.kv, "--kv-mib", str(a.kv_mib), "--tier", str(a.tier),
                   "--contexts", a.contexts, "--decode-tokens", str(a.decode_tokens)]
    res: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "hardware": hardware("cpu"),
                 "cpu": platform.processor(), "cores": os.cpu_count(), "loadavg_start": os.getloadavg(),
                 "shape": a.shape, "ranks": a.ranks, "oversubscribed": a.ranks > (os.cpu_count() or 1), "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        for name, launch in (("one_rank", [sys.executable, __file__]),
                             (f"{a.ranks}_ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={a.ranks}", __file__])):
            out = Path(d) / f"{name}.json"
            t = time.perf_counter()
            r = subprocess.run([*launch, *passthrough, "--result", str(out)], env=env, cwd=ROOT,
                               capture_output=True, text=True)
            if r.returncode != 0 or not out.exists():
                raise SystemExit(f"{name} failed ({r.returncode}):\n{r.stderr[-4000:]}")
            res["runs"][name] = {**json.loads(out.read_text()), "wall_s": round(time.perf_counter() - t, 1)}
            print(name, json.dumps(res["runs"][name]["contexts"]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2, default=str))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
