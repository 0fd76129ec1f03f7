"""CPU cell benchmark on the real SmolLM2-135M-Instruct, through the Engine (the same path the server calls).

Measures
  * prefill tok/s of a cold session at 1k / 4k / 8k tokens of real text (Python standard-library sources),
  * first-output latency (decode call -> first token) and per-token decode p50 / p90 / p95 after that prefill,
  * a 10-turn agent replay: each turn appends ~700 tokens of "tool output" (more library source) to a ChatML
    transcript and generates 32 greedy tokens; once with prefix reuse (ensure_prefix keeps the transcript's KV),
    once without (prefixReuse off and a new session every turn: the whole transcript recomputed).
Writes JSON (--out) and prints a table. Timings are medians over --repeats runs after one warm-up.

    PYTHONPATH=cellimage:api python benchmarks/cell_cpu.py --weights bf16 --out _out/cell_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch

from modeld_cell.engine import Engine, SamplingParams
from modeld_cell.models.fetch import SMOLLM2_REF


def corpus_text() -> str:
    """Real English/Python text: standard-library sources, a fixed list so runs compare."""
    import asyncio.base_events
    import email.message
    import json.decoder
    import logging
    import typing
    return "\n".join(open(inspect.getsourcefile(m)).read()  # type: ignore[arg-type]
                     for m in (asyncio.base_events, logging, typing, email.message, json.decoder))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def one_context(eng: Engine, ids: list[int], n: int, decode_tokens: int, tag: str) -> dict:
    sid = f"ctx-{tag}-{n}"
    eng.clear_prefix_cache()         # cold: no blocks of an earlier run of the same text (cross-session reuse)
    t = time.perf_counter()
    tr = await eng.ensure_prefix(sid, ids[:n])
    prefill_s = time.perf_counter() - t
    assert tr.tokens_computed == n
    per_tok: list[float] = []
    first = None
    async for ev in eng.decode(sid, SamplingParams(), decode_tokens, stop_token_ids=[]):
        if ev.done:
            first = ev.trace.first_output_ms
            per_tok = ev.trace.decode_ms_per_token
    eng.close_session(sid)
    return {"prefill_s": prefill_s, "prefill_tok_s": n / prefill_s, "first_output_ms": first,
            "decode_ms": per_tok}


async def replay(eng: Engine, chunks: list[str], turns: int, gen: int, tag: str) -> dict:
    tok = eng.tokenizer
    msgs = [{"role": "system", "content": "You are a coding agent. Read tool output and decide the next step."},
            {"role": "user", "content": "Investigate the module and summarise what it does."}]
    sid = f"replay-{tag}"
    per_turn = []
    t_all = time.perf_counter()
    for i in range(turns):
        msgs.append({"role": "user", "content": f"<tool_output turn={i}>\n{chunks[i]}\n</tool_output>"})
        ids = tok.encode(tok.apply_chat_template(msgs))
        t0 = time.perf_counter()
        if tag == "recompute" and i:
            eng.close_session(sid)           # a fresh session and no prefix index: the whole transcript recomputed
        tr = await eng.ensure_prefix(sid, ids)
        first = None
        out: list[int] = []
        async for ev in eng.decode(sid, SamplingParams(), gen, stop_token_ids=[]):
            if ev.done:
                first = ev.trace.first_output_ms
            else:
                out.append(ev.token_id)
        turn_s = time.perf_counter() - t0
        prefill_s = tr.total_ms / 1e3
        per_turn.append({"context": len(ids), "computed": tr.tokens_computed, "reused": tr.tokens_reused,
                         "first_output_s": prefill_s + (first or 0) / 1e3, "turn_s": turn_s})
        msgs.append({"role": "assistant", "content": tok.decode([t for t in out if t not in tok.eos_token_ids])})
    total = time.perf_counter() - t_all
    eng.close_session(sid)
    return {"total_s": total, "turns": per_turn}


def tool_chunks(text: str, eng: Engine, turns: int, size: int = 700) -> list[str]:
    ids = eng.tokenizer.encode(text)
    return [eng.tokenizer.decode(ids[i * size : (i + 1) * size]) for i in range(turns)]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--kv", default=None, help="KV dtype (default: same as weights)")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--out", default="_out/cell_cpu.json")
    a = ap.parse_args()
    spec = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": a.weights, "kv": a.kv or a.weights, "prefixReuse": True},
            "contextTier": 8192, "kvMemoryMiB": 2048}
    t = time.perf_counter()
    eng = Engine.from_cell(spec)
    load_s = time.perf_counter() - t
    text = corpus_text()
    ids = eng.tokenizer.encode(text)
    res: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "load_s": load_s,
                 "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
                 "loadavg_start": os.getloadavg(), "weights": a.weights, "kv": a.kv or a.weights,
                 "capability": {k: eng.capability()[k] for k in ("kv", "runtime", "attention")}, "contexts": {}}
    await one_context(eng, ids, 256, 4, "warm")  # warm-up: first-call allocations, thread pools
    for n in (int(x) for x in a.contexts.split(",")):
        n = min(n, eng.context_tier - a.decode_tokens)  # "8k": leave room in the 8192 tier for the decoded tokens
        runs = [await one_context(eng, ids, n, a.decode_tokens, f"r{r}") for r in range(a.repeats)]
        dec = [x for r in runs for x in r["decode_ms"]]
        res["contexts"][n] = {
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "first_output_ms": statistics.median(r["first_output_ms"] for r in runs),
            "decode_p50_ms": pct(dec, 50), "decode_p90_ms": pct(dec, 90), "decode_p95_ms": pct(dec, 95),
        }
    if not a.skip_replay:
        chunks = tool_chunks(text[len(text) // 3 :], eng, a.turns)
        res["replay_reuse"] = await replay(eng, chunks, a.turns, 32, "reuse")
        reuse_cfg = eng.config
        eng.config = reuse_cfg.with_profile(prefixReuse=False)   # same engine, no index, a new session each turn
        res["replay_recompute"] = await replay(eng, chunks, a.turns, 32, "recompute")
        eng.config = reuse_cfg
    res["loadavg_end"] = os.getloadavg()
    try:
        with open("/proc/self/status") as f:
            res["peak_rss_mib"] = next(int(ln.split()[1]) // 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"modeld torch CPU, weights {a.weights}, kv {a.kv or a.weights}, threads {res['threads']}, "
          f"torch {res['torch']}, load avg {res['loadavg_start'][0]:.1f}")
    print(f"{'context':>8} {'prefill tok/s':>14} {'first out ms':>13} {'p50 ms':>8} {'p90 ms':>8} {'p95 ms':>8}")
    for n, r in res["contexts"].items():
        print(f"{n:>8} {r['prefill_tok_s']:>14.0f} {r['first_output_ms']:>13.1f} {r['decode_p50_ms']:>8.1f} "
              f"{r['decode_p90_ms']:>8.1f} {r['decode_p95_ms']:>8.1f}")
    for k in ("replay_reuse", "replay_recompute"):
        if k in res:
            last = res[k]["turns"][-1]
            print(f"{k:>17}: total {res[k]['total_s']:.1f} s; last turn at {last['context']} tokens: first output "
                  f"{last['first_output_s']:.2f} s, whole turn {last['turn_s']:.2f} s")
    print(f"peak RSS {res.get('peak_rss_mib')} MiB; JSON: {a.out}")


if __name__ == "__main__":
    asyncio.run(main())
