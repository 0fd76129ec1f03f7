"""The CPU cell's weights paths side by side: where a prefill and a decode step spend their time, per op, and what
each path (dense fp32 / bf16, int8 and q4_1 weight-only kernels) costs and buys on this machine.

Each path runs in its own process (RSS after load is then the path's own), forced with MODELD_WEIGHTS_PATH, on the
real SmolLM2-135M Q4_1 GGUF: ``profile.weights`` q4_1 for the dense and q4_1 paths, int8 for int8. Per path:
  * load seconds, RSS right after load, the weights' bytes as served, the quality smoke's verdict of a quantized
    kernel (profile_gate, against the checkpoint in fp32; cached under --cache like the worker's);
  * cold prefill tok/s at each --contexts and decode ms/token p50 over --decode-tokens greedy tokens after it;
  * a torch-profiler breakdown (self CPU time per op, top --top ops) of one cold 1k prefill and of 16 decode steps
    after it, recorded on the engine's torch thread (where every forward runs), plus the wall time of each.
The autotune measurement (what ``auto`` would choose, with every candidate's figures) is recorded once.

    .venv/bin/python benchmarks/weights_cpu.py --out docs/bench/DATE/weights_cpu.json

Figures vary by CPU and by what else runs: the JSON records the CPU, torch, threads and load average.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATHS = {"dense-fp32": "q4_1", "dense-bf16": "q4_1", "q4_1-fp32": "q4_1", "q4_1-bf16": "q4_1",
         "int8-fp32": "int8", "int8-bf16": "int8"}
DEFAULT_PATHS = "dense-fp32,dense-bf16,q4_1-bf16,int8-bf16"


def spec(weights: str, tier: int) -> dict:
    from modeld_cell.models.fetch import SMOLLM2_REF
    return {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": weights, "kv": "bf16", "attention": "dense", "prefixReuse": True},
            "contextTier": tier, "kvMemoryMiB": 512}


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("VmRSS:"))


def top_ops(prof, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count,
             "share": round(e.self_cpu_time_total / total, 4)} for e in rows[:n]] + [
        {"op": "(all ops)", "self_ms": round(total / 1e3, 2), "calls": sum(e.count for e in rows), "share": 1.0}]


def worker(a: argparse.Namespace) -> dict:
    """One path, in this process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO / "benchmarks"))
    from cell_cpu import corpus_text

    from modeld_cell.contract import SamplingParams
    from modeld_cell.engine import Engine
    from modeld_cell.quantize import weights_bytes

    contexts = [int(x) for x in a.contexts.split(",")]
    if a.row_tile is not None:                      # the tile the loader tries when untiled packed rows differ
        from modeld_cell import model as M
        M.ROW_TILE = a.row_tile
    t0 = time.perf_counter()
    eng = Engine.from_cell(spec(PATHS[a.path], max(contexts) + 64), quality_cache=a.cache)
    out: dict = {"path": a.path, "row_tile_tried": a.row_tile, "profile_weights": PATHS[a.path],
                 "load_s": round(time.perf_counter() - t0, 1),
                 "rss_after_load_mib": rss_mib(), "weights_mib": round(weights_bytes(eng.model) / 2**20, 1),
                 "chosen": f"{eng.config.weights_kernel}-{eng.config.weights}",
                 "weights_layout": eng.identity["weights_kernel"], "exactness_probe": eng.model.chunking_probe,
                 "reuse_exactness": eng.reuse_report()["exactness"],
                 "quality": [{k: v[k] for k in ("profile", "passed", "failures", "result", "thresholds", "cached")}
                             for v in eng.quality]}
    ids = eng.tokenizer.encode(corpus_text())
    ex = eng._thread._executor                      # the engine's torch thread: the profiler records there

    async def context(n: int, decode: int, prof_prefill=None, prof_decode=None) -> dict:
        sid = f"c{n}-{time.monotonic_ns()}"
        eng.clear_prefix_cache()
        if prof_prefill is not None:
            ex.submit(prof_prefill.__enter__).result()
        t = time.perf_counter()
        tr = await eng.ensure_prefix(sid, ids[:n])
        prefill_s = time.perf_counter() - t
        if prof_prefill is not None:
            ex.submit(prof_prefill.__exit__, None, None, None).result()
        assert tr.tokens_computed == n
        if prof_decode is not None:
            ex.submit(prof_decode.__enter__).result()
        t = time.perf_counter()
        per_tok: list[float] = []
        async for ev in eng.decode(sid, SamplingParams(), decode, stop_token_ids=[]):
            if ev.done:
                per_tok = ev.trace.decode_ms_per_token
        decode_s = time.perf_counter() - t
        if prof_decode is not None:
            ex.submit(prof_decode.__exit__, None, None, None).result()
        eng.close_session(sid)
        return {"prefill_s": round(prefill_s, 3), "prefill_tok_s": round(n / prefill_s, 1),
                "decode_ms_p50": round(statistics.median(per_tok[1:]), 2), "decode_wall_s": round(decode_s, 3)}

    async def main() -> None:
        await context(256, 4)                                       # warm-up
        out["contexts"] = {str(n): await context(n, a.decode_tokens) for n in contexts}
        pp, pd = profile(activities=[ProfilerActivity.CPU]), profile(activities=[ProfilerActivity.CPU])
        r = await context(1024, 17, pp, pd)
        out["profile_1k"] = {"prefill_wall_s": r["prefill_s"], "prefill_ops": top_ops(pp, a.top),
                             "decode_steps": 16, "decode_wall_s": r["decode_wall_s"],
                             "decode_ops": top_ops(pd, a.top)}

    asyncio.run(main())
    out["autotune"] = eng.config.weights_choice
    out["decode_threads"] = eng.runner.decode_threads_report
    out["decoded_kv"] = eng.runner.decoded_kv_report
    out["threads"] = torch.get_num_threads()
    eng.shutdown()
    return out


def listed(ap: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]) -> list[str | None]:
    """A comma-separated setting's values ([None]: not given, the worker's default), each one of ``allowed``."""
    got: list[str | None] = list(value.split(",")) if value else [None]
    if any(v not in allowed for v in got if v is not None):
        ap.error(f"{flag} takes {', '.join(allowed[:-1])} and/or {allowed[-1]}, got {value!r}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default=DEFAULT_PATHS, help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=12, help="ops per profile")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "modeld"),
                    help="the quality / autotune cache (the worker's default)")
    ap.add_argument("--row-tiles", default="",
                    help="comma-separated row tiles the loader tries where untiled packed rows are not invariant "
                         "(model.ROW_TILE; 0: none, the weights go plain); each path runs once per tile")
    ap.add_argument("--heads", default="",
                    help="comma-separated int8 / dense: a quantized path's head where the file keeps it in Q8_0 "
                         "(MODELD_INT8_HEAD 1 / 0; quantize.head_kernel); each path runs once per head")
    ap.add_argument("--decode-threads", default="",
                    help="comma-separated MODELD_DECODE_THREADS settings (auto, or a count); each path runs once "
                         "per setting (runner.choose_decode_threads; the JSON keeps each run's report)")
    ap.add_argument("--decoded-kv", default="",
                    help="comma-separated MODELD_DECODED_KV settings (auto, exact, recompute); each path runs once "
                         "per setting (runner.choose_decoded_kv; the JSON keeps each run's report)")
    ap.add_argument("--cpu-kernels", default="",
                    help="comma-separated MODELD_CPU_KERNELS settings (auto, on, off: the recomputing step's CPU "
                         "attention kernel); each path runs once per setting")
    ap.add_argument("--out", default="_out/weights_cpu.json")
    ap.add_argument("--row-tile", type=int, help=argparse.SUPPRESS)    # worker mode
    ap.add_argument("--path", help=argparse.SUPPRESS)           # worker mode: one path, JSON on stdout
    a = ap.parse_args()
    if a.path:
        print(json.dumps(worker(a)))
        return
    runs = []
    tiles: list[int | None] = [int(t) for t in a.row_tiles.split(",")] if a.row_tiles else [None]
    heads = listed(ap, "--heads", a.heads, ("int8", "dense"))
    dthreads: list[str | None] = a.decode_threads.split(",") if a.decode_threads else [None]
    if any(d != "auto" and not d.isdigit() for d in dthreads if d is not None):
        ap.error(f"--decode-threads takes auto and/or thread counts, got {a.decode_threads!r}")
    dkvs = listed(ap, "--decoded-kv", a.decoded_kv, ("auto", "exact", "recompute"))
    cks = listed(ap, "--cpu-kernels", a.cpu_kernels, ("auto", "on", "off"))
    for p, tile, head, dt, dkv, ck in [(p, t, h, d, k, c) for p in a.paths.split(",") for t in tiles for h in heads
                                       for d in dthreads for k in dkvs for c in cks]:
        if p not in PATHS:
            ap.error(f"unknown path {p!r}; known: {', '.join(PATHS)}")
        env = {**os.environ, "MODELD_WEIGHTS_PATH": p}
        if head is not None:
            env["MODELD_INT8_HEAD"] = "1" if head == "int8" else "0"
        if dt is not None:
            env["MODELD_DECODE_THREADS"] = dt
        if dkv is not None:
            env["MODELD_DECODED_KV"] = dkv
        if ck is not None:
            env["MODELD_CPU_KERNELS"] = ck
        cmd = [sys.executable, __file__, "--path", p, "--contexts", a.contexts, "--decode-tokens",
               str(a.decode_tokens), "--top", str(a.top), "--cache", a.cache] + (
               ["--row-tile", str(tile)] if tile is not None else [])
        load0 = os.getloadavg()[0]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            runs.append({"path": p, "head_asked": head, "decode_threads_asked": dt, "decoded_kv_asked": dkv,
                         "cpu_kernels_asked": ck, "error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})
            print(f"{p}: failed: {runs[-1]['error']}", file=sys.stderr)
            continue
        run = json.loads(r.stdout.strip().splitlines()[-1])
        run["loadavg_before"] = round(load0, 2)
        run["head_asked"] = head
        run["decode_threads_asked"] = dt
        run["decoded_kv_asked"] = dkv
        run["cpu_kernels_asked"] = ck
        runs.append(run)
        c = run["contexts"]
        dtr = run["decode_threads"] or {}
        print(f"{p:11s} {run['weights_layout']} ({run['reuse_exactness']}) decode threads {dtr.get('threads')}"
              f" head {dtr.get('head_threads')} decoded K/V {(run['decoded_kv'] or {}).get('decoded_kv')}"
              f" attention {((run['decoded_kv'] or {}).get('attention') or {}).get('served')} load {run['load_s']:5.1f} s  "
              f"rss {run['rss_after_load_mib']} MiB  weights {run['weights_mib']} MiB  "
              + "  ".join(f"{n}: prefill {v['prefill_tok_s']} tok/s decode {v['decode_ms_p50']} ms"
                          for n, v in c.items()))
    from modeld_cell.profile_gate import hardware
    res = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "hardware": hardware("cpu"),
           "host": platform.node(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
