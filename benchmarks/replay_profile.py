"""Where the agent replay's time goes on the CPU cell, turn by turn: the replay of benchmarks/peers_cpu.py (same
corpus, same token ids, same engine spec: ``profile.weights`` q4_1 as the worker's measurement at start serves it,
an 8192-token tier, prefix reuse on) run twice in one process after one load.

  round 1  timed: per turn the append (ensure_prefix: the new tokens plus the reply the session has not yet cached)
           and the decode (--gen greedy tokens), each by wall clock, with the engine's own token accounting
  round 2  the same turns (prefix cache cleared, a new session) under the torch profiler on the engine's torch
           thread, one profile per phase: self CPU time per op, grouped into the row/segmented attention, the
           linears, and the rest; ``outside_ops_ms`` is the phase's wall less the ops' self time (Python, the event
           loop, sampling, scheduling between ops, and any C call the profiler does not see as an op: the
           recomputing decode step's whole-layer C kernel is one, so a decode phase is mostly "outside ops")

    .venv/bin/python benchmarks/replay_profile.py --out docs/bench/DATE/replay_profile.json

Figures vary by CPU and by what else runs (this project's 2-core VM moves by up to 40% within an hour): the JSON
records the CPU, torch, threads and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "cellimage"))
sys.path.insert(0, str(REPO / "benchmarks"))

# op names by group (self CPU time); anything else is "other"
GROUPS = {
    "attention": ("modeld::rows_attention_cpu", "modeld::paged_decode_cpu", "aten::_scaled_dot_product_flash_attention",
                  "aten::_flash_attention_forward", "aten::_scaled_dot_product_flash_attention_for_cpu"),
    "linears": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
                "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "modeld::row_linear_cpu"),
}


def grouped(prof, top: int) -> dict:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / 1e3
    out = {g: 0.0 for g in (*GROUPS, "other")}
    for e in rows:
        g = next((g for g, names in GROUPS.items() if e.key in names), "other")
        out[g] += e.self_cpu_time_total / 1e3
    return {"ops_ms": round(total, 1), **{f"{g}_ms": round(v, 1) for g, v in out.items()},
            "top": [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count}
                    for e in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--append", type=int, default=700)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--after", type=int, default=8160, help="the replay's text starts after this many corpus tokens "
                    "(peers_cpu.py: after its longest context)")
    ap.add_argument("--weights", default="q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--out", default="_out/replay_profile.json")
    a = ap.parse_args()

    import torch
    from peers_cpu import _kv_default, model_path, modeld_engine, tokenize
    from torch.profiler import ProfilerActivity, profile

    from modeld_cell.engine import SamplingParams
    from modeld_cell.profile_gate import hardware

    model = model_path(None)
    ids, _ = tokenize(model)
    text = ids[a.after: a.after + a.turns * a.append]
    if len(text) < a.turns * a.append:
        raise SystemExit(f"the corpus has {len(ids)} tokens: too few for the replay")
    out: dict = {"command": " ".join(["replay_profile.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "loadavg_start": round(os.getloadavg()[0], 2)}
    t0 = time.perf_counter()
    eng = modeld_engine({"model": model, "modeld_weights": a.weights, "modeld_kv": _kv_default(), "modeld_kv_mib": 512,
                         "threads": a.threads})
    out.update(load_s=round(time.perf_counter() - t0, 1), threads=torch.get_num_threads(),
               weights=f"{eng.config.weights_kernel}-{eng.config.weights}", kv=eng.config.kv,
               kernels=eng.runner.kernels())
    ex = eng._thread._executor

    async def phase(prof_on: bool, call):  # noqa: ANN001
        prof = profile(activities=[ProfilerActivity.CPU]) if prof_on else None
        if prof is not None:
            ex.submit(prof.__enter__).result()
        t = time.perf_counter()
        res = await call()
        wall = (time.perf_counter() - t) * 1e3
        rec: dict = {"wall_ms": round(wall, 1)}
        if prof is not None:
            ex.submit(prof.__exit__, None, None, None).result()
            rec.update(grouped(prof, a.top))
            rec["outside_ops_ms"] = round(wall - rec["ops_ms"], 1)
        return res, rec

    async def replay(sid: str, prof_on: bool) -> list[dict]:
        conv: list[int] = []
        turns = []
        for i in range(a.turns):
            conv = conv + text[i * a.append: (i + 1) * a.append]
            tr, app = await phase(prof_on, lambda c=conv: eng.ensure_prefix(sid, c))
            app.update(tokens_computed=tr.tokens_computed, context=len(conv))

            async def dec() -> list[int]:
                toks = []
                async for ev in eng.decode(sid, SamplingParams(), a.gen, stop_token_ids=[]):
                    if not ev.done:
                        toks.append(ev.token_id)
                return toks

            toks, d = await phase(prof_on, dec)
            d["ms_per_token"] = round(d["wall_ms"] / max(1, len(toks)), 2)
            conv = conv + toks
            turns.append({"turn": i + 1, "append": app, "decode": d})
            print(f"{'profiled' if prof_on else 'timed'} turn {i + 1}: context {len(conv)}, append "
                  f"{app['tokens_computed']} tok {app['wall_ms']:.0f} ms, decode {d['wall_ms']:.0f} ms"
                  + (f" (outside ops {app['outside_ops_ms']:.0f} / {d['outside_ops_ms']:.0f} ms)" if prof_on else ""),
                  flush=True)
        eng.close_session(sid)
        eng.clear_prefix_cache()
        return turns

    async def run() -> None:
        eng.clear_prefix_cache()
        out["timed"] = await replay("replay-timed", False)
        out["timed_total_s"] = round(sum(t["append"]["wall_ms"] + t["decode"]["wall_ms"] for t in out["timed"]) / 1e3,
                                     2)
        out["profiled"] = await replay("replay-profiled", True)

    asyncio.run(run())
    eng.shutdown()
    p = out["profiled"]
    out["profiled_sums_ms"] = {
        ph: {k: round(sum(t[ph][k] for t in p), 1) for k in
             ("wall_ms", "ops_ms", "attention_ms", "linears_ms", "other_ms", "outside_ops_ms")}
        for ph in ("append", "decode")}
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    print(f"timed replay {out['timed_total_s']} s; profiled sums {out['profiled_sums_ms']}")
    from benchjson import write
    write(out, a.out)


if __name__ == "__main__":
    main()
