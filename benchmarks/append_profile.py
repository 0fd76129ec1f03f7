"""Where an agent turn's append goes on the CPU cell: the worker's engine as it loads (``profile.weights`` q4_1,
``auto``), a --past-token prefix prefilled and kept in the prefix cache, then --reps appends of --append new tokens
after it (each a different continuation, so the prefix is reused exactly and only the append is computed), timed,
the last one under the torch profiler (self CPU time per op, on the engine's torch thread).

Each MODELD_PREFILL_ATTENTION value in --settings runs in its own process, in turn, --rounds times: a comparison
of the prefill attentions on the real model, alternated so a slow stretch of the machine hits both.

    .venv/bin/python benchmarks/append_profile.py --out docs/bench/DATE/append_profile.json

Figures vary by CPU and by what else runs: the JSON records the CPU, torch, threads and load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "cellimage"))
sys.path.insert(0, str(REPO / "benchmarks"))


def worker(a: argparse.Namespace) -> dict:
    import torch
    from cell_cpu import corpus_text
    from torch.profiler import ProfilerActivity, profile
    from weights_cpu import spec, top_ops

    from modeld_cell.engine import Engine

    t0 = time.perf_counter()
    eng = Engine.from_cell(spec("q4_1", a.past + a.append + 64), quality_cache=a.cache)
    out: dict = {"setting": os.environ.get("MODELD_PREFILL_ATTENTION", "auto"),
                 "load_s": round(time.perf_counter() - t0, 1),
                 "prefill_attention": eng.runner.kernels()["prefill"],
                 "choice": getattr(eng.model, "row_attention_report", None),
                 "chosen_weights": f"{eng.config.weights_kernel}-{eng.config.weights}",
                 "threads": torch.get_num_threads()}
    ids = eng.tokenizer.encode(corpus_text())
    need = a.past + (a.reps + 1) * 1000
    if len(ids) < need:
        raise SystemExit(f"the corpus has {len(ids)} tokens, {need} needed")
    ex = eng._thread._executor

    async def main() -> None:
        t = time.perf_counter()
        tr = await eng.ensure_prefix("past", ids[: a.past])
        out["past_prefill_s"] = round(time.perf_counter() - t, 2)
        assert tr.tokens_computed == a.past
        eng.close_session("past")
        walls, computed = [], []
        for r in range(a.reps):
            prof = profile(activities=[ProfilerActivity.CPU]) if r == a.reps - 1 else None
            start = a.past + 1000 * (r + 1)
            toks = ids[: a.past] + ids[start : start + a.append]
            if prof is not None:
                ex.submit(prof.__enter__).result()
            t = time.perf_counter()
            tr = await eng.ensure_prefix(f"a{r}", toks)
            wall = time.perf_counter() - t
            if prof is not None:
                ex.submit(prof.__exit__, None, None, None).result()
                out["profiled_s"] = round(wall, 3)
                out["ops"] = top_ops(prof, a.top)
            else:
                walls.append(wall)
            computed.append(tr.tokens_computed)
            eng.close_session(f"a{r}")
        out["append_s"] = [round(w, 3) for w in walls]
        out["append_s_median"] = round(statistics.median(walls), 3)
        out["tokens_computed"] = computed

    asyncio.run(main())
    eng.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--past", type=int, default=6556, help="tokens cached before the append (the replay's last turn)")
    ap.add_argument("--append", type=int, default=700)
    ap.add_argument("--reps", type=int, default=4, help="appends per process; the last one profiled")
    ap.add_argument("--settings", default="segmented,rows", help="MODELD_PREFILL_ATTENTION values")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/modeld/quality"))
    ap.add_argument("--out", default="_out/append_profile.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return
    from modeld_cell.profile_gate import hardware

    out: dict = {"command": " ".join(["append_profile.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
                 "loadavg_start": round(os.getloadavg()[0], 2),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    args = [a2 for a2 in sys.argv[1:] if a2 != "--worker"]
    for r in range(a.rounds):
        for s in a.settings.split(","):
            env = {**os.environ, "MODELD_PREFILL_ATTENTION": s}
            p = subprocess.run([sys.executable, __file__, *args, "--worker"], env=env, capture_output=True, text=True,
                               check=False)
            if p.returncode != 0:
                raise SystemExit(f"{s}: the worker failed:\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res["round"] = r + 1
            out["runs"].append(res)
            print(f"round {r + 1} {s}: append {a.append} after {a.past}: {res['append_s']} s (median "
                  f"{res['append_s_median']}); {res['prefill_attention']}", flush=True)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchjson import write
    write(out, a.out)


if __name__ == "__main__":
    main()
