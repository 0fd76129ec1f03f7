"""Multi-turn agent replay on the real SmolLM2-135M-Instruct: prefix reuse vs recompute vs the suffix-only floor,
a branch from a shared prefix, and snapshot restore vs recompute, side by side in one run (docs/reuse.md).

The transcript (ChatML) grows to ~8k tokens: a task, then --turns tool outputs of --chunk tokens each (Python
standard-library source), each followed by a fixed assistant note, then --tail-turns short user follow-ups at the
~8k stable prefix. Every turn generates --gen greedy tokens. The same prompts run through three engines that share
the loaded weights:

  reuse     prefixReuse on: one session; ensure_prefix keeps the transcript's KV (and finds cached blocks)
  recompute prefixReuse off and a new session every turn: the whole transcript runs through prefill
  floor     on the reuse engine, a session that already holds exactly the stable prefix; only the new suffix is
            prefilled (prefill_suffix), no lookup: the physical floor of a reused turn
  branch    at --branch-at, a new session that shares the transcript up to that turn's tool output and then asks
            something else (cross-session hit, copy-on-write at the divergence block), vs a cold session
  restore   the final ~8k prompt, snapshotted from the reuse engine and restored into a fresh engine (same
            process; the file is in the page cache), vs recomputing that prompt

First output = wall time from the request (ensure_prefix / prefill_suffix / restore) to the first generated token.

    PYTHONPATH=cellimage:api .venv/bin/python benchmarks/agent_replay.py --out _out/agent_replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import sys
import tempfile
import time

import torch

from modeld_cell.config import cpu_compute_dtype
from modeld_cell.engine import CellConfig, Engine, EngineSettings, SamplingParams
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.models.fetch import SMOLLM2_REF
from modeld_cell.tokenizer import common_prefix

SYSTEM = "You are a coding agent. Read each tool output, keep notes, and decide the next step."
TASK = "Investigate these standard-library modules and explain how they fit together."
NOTE = "Noted. Reading the next part."
FOLLOW_UPS = ["Which function in the last output is the most important, and why?",
              "Summarise in one sentence what you have learned so far.",
              "Name one risk in this code.", "What would you test first?"]
BRANCH_ASK = "Stop reading. List the classes you have seen so far."


def corpus() -> str:
    import asyncio.base_events
    import email.message
    import json.decoder
    import logging
    import typing
    return "\n".join(open(inspect.getsourcefile(m)).read()  # type: ignore[arg-type]
                     for m in (asyncio.base_events, logging, typing, email.message, json.decoder))


def build_prompts(eng: Engine, turns: int, chunk: int, tail: int) -> tuple[list[list[int]], list[dict]]:
    """Token ids of each turn's prompt (with the assistant header), and the message list of every turn."""
    tok = eng.tokenizer
    ids = tok.encode(corpus())
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    prompts, states = [], []
    for i in range(turns + tail):
        if i:
            msgs.append({"role": "assistant", "content": NOTE})
        if i < turns:
            body = tok.decode(ids[i * chunk : (i + 1) * chunk])
            msgs.append({"role": "user", "content": f"<tool_output turn={i}>\n{body}\n</tool_output>"})
        else:
            msgs.append({"role": "user", "content": FOLLOW_UPS[(i - turns) % len(FOLLOW_UPS)]})
        prompts.append(tok.encode(tok.apply_chat_template(msgs)))
        states.append([dict(m) for m in msgs])
    return prompts, states


def agree(a: list[int], b: list[int]) -> str:
    """'n/n' tokens equal before the first difference."""
    return f"{common_prefix(a, b)}/{max(len(a), len(b))}"


async def first_token(eng: Engine, sid: str, gen: int) -> tuple[float, list[int]]:
    """Decode gen greedy tokens; returns (seconds to the first token event from now, tokens)."""
    t = time.perf_counter()
    first, out = None, []
    async for ev in eng.decode(sid, SamplingParams(), gen, stop_token_ids=[]):
        if not ev.done:
            if first is None:
                first = time.perf_counter() - t
            out.append(ev.token_id)
    return first or 0.0, out


async def turn(eng: Engine, sid: str, ids: list[int], gen: int) -> dict:
    """One turn. On the recompute engine (prefixReuse off) the session is new every turn: nothing is reused."""
    if not eng.config.prefix_reuse and sid in eng._sessions:
        eng.close_session(sid)
    t0 = time.perf_counter()
    tr = await eng.ensure_prefix(sid, ids)
    pre = time.perf_counter() - t0
    f, out = await first_token(eng, sid, gen)
    return {"first_output_s": pre + f, "turn_s": time.perf_counter() - t0, "reused": tr.tokens_reused,
            "computed": tr.tokens_computed, "prefill_ms": tr.prefill_ms, "reuse": tr.reuse, "tokens": out}


def sibling(base: Engine, kv_mib: int, prefix_reuse: bool) -> Engine:
    """Another engine over the same loaded weights, with its own KV pool."""
    spec = dict(base.config.raw)
    spec["profile"] = {**(spec.get("profile") or {}), "prefixReuse": prefix_reuse}
    spec["kvMemoryMiB"] = kv_mib
    cfg = CellConfig.from_spec(spec)
    a = base.model.args
    cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(cfg.kv), kv_mib << 20)
    return Engine(base.model, base.tokenizer, cache, cfg, dict(base.identity),
                  EngineSettings(threads=base.settings.threads))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default=cpu_compute_dtype(),
                    help="profile.weights (default: bf16 where the CPU computes it natively, else fp32)")
    ap.add_argument("--turns", type=int, default=10, help="tool-output turns")
    ap.add_argument("--chunk", type=int, default=740, help="tokens of tool output per turn")
    ap.add_argument("--tail-turns", type=int, default=2, help="short follow-ups at the ~8k stable prefix")
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per turn")
    ap.add_argument("--branch-at", type=int, default=6)
    ap.add_argument("--kv-mib", type=int, default=512, help="KV budget of each engine")
    ap.add_argument("--out", default="_out/agent_replay.json")
    a = ap.parse_args()
    spec = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": a.weights, "kv": a.weights, "attention": "dense", "prefixReuse": True},
            "contextTier": 8192, "kvMemoryMiB": a.kv_mib}
    t = time.perf_counter()
    reuse = Engine.from_cell(spec)
    load_s = time.perf_counter() - t
    cold = sibling(reuse, a.kv_mib, prefix_reuse=False)
    prompts, states = build_prompts(reuse, a.turns, a.chunk, a.tail_turns)
    if len(prompts[-1]) + a.gen > reuse.context_tier:
        sys.exit(f"the last prompt has {len(prompts[-1])} tokens; with --gen {a.gen} it exceeds the tier "
                 f"{reuse.context_tier}: lower --chunk")
    res: dict = {"command": " ".join(["python"] + sys.argv), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                 "nproc": os.cpu_count(), "loadavg_start": os.getloadavg(), "load_s": load_s,
                 "weights_dtype": reuse.config.weights, "kv_dtype": reuse.config.kv,
                 "prompt_tokens": [len(p) for p in prompts], "turns": []}
    # warm-up: allocations and thread pools of both engines
    for eng in (reuse, cold):
        await turn(eng, "warm", prompts[0][:300], 2)
        eng.close_session("warm")
    reuse.clear_prefix_cache()

    prev: list[int] = []
    for i, ids in enumerate(prompts):
        row: dict = {"turn": i, "context": len(ids), "stable_prefix": common_prefix(prev, ids)}
        row["new_tokens"] = len(ids) - row["stable_prefix"]
        r = await turn(reuse, "agent", ids, a.gen)
        c = await turn(cold, "agent", ids, a.gen)
        if prev:
            # the floor: suffix-only prefill on a session holding exactly the past (after the reuse turn, so the
            # reuse turn cannot profit from it; prefill_suffix never looks blocks up)
            await reuse.ensure_prefix("floor", ids[: row["stable_prefix"]])
            t0 = time.perf_counter()
            tr = await reuse.prefill_suffix("floor", ids[row["stable_prefix"] :])
            pre = time.perf_counter() - t0
            f, _ = await first_token(reuse, "floor", 1)
            row["floor_first_output_s"], row["floor_prefill_ms"] = pre + f, tr.prefill_ms
            reuse.close_session("floor")
        # identical in fp32 and bf16 alike: the CPU path is chunking-invariant (tests/cell/test_invariance.py)
        row["greedy_tokens_agree"] = agree(r["tokens"], c["tokens"])
        row.update({f"reuse_{k}": v for k, v in r.items() if k != "tokens"})
        row.update({f"recompute_{k}": v for k, v in c.items() if k != "tokens"})
        row["speedup"] = c["first_output_s"] / r["first_output_s"]
        if "floor_first_output_s" in row:
            row["reuse_over_floor"] = r["first_output_s"] / row["floor_first_output_s"]
        res["turns"].append(row)
        print(f"turn {i:2d} ctx {len(ids):5d} new {row['new_tokens']:5d}: reuse {r['first_output_s']:6.2f} s, "
              f"recompute {c['first_output_s']:6.2f} s, floor {row.get('floor_first_output_s', float('nan')):6.2f} s",
              flush=True)
        if i == a.branch_at:                       # a branch off the transcript at this turn
            msgs = states[i] + [{"role": "user", "content": BRANCH_ASK}]
            bids = reuse.tokenizer.encode(reuse.tokenizer.apply_chat_template(msgs))
            br, bc = await turn(reuse, "branch", bids, a.gen), await turn(cold, "branch", bids, a.gen)
            res["branch"] = {"greedy_tokens_agree": agree(br["tokens"], bc["tokens"]),"at_turn": i, "context": len(bids), "shared_with_trunk": common_prefix(ids, bids),
                             "reuse_first_output_s": br["first_output_s"], "reuse": br["reuse"],
                             "recompute_first_output_s": bc["first_output_s"],
                             "speedup": bc["first_output_s"] / br["first_output_s"]}
            reuse.close_session("branch")
            cold.close_session("branch")
        prev = ids
    res["replay_total_s"] = {k: sum(r[f"{k}_turn_s"] for r in res["turns"]) for k in ("reuse", "recompute")}

    # snapshot / restore of the final prompt vs recomputing it (the recompute engine's last turn ran exactly it)
    last = prompts[-1]
    await reuse.ensure_prefix("snap", last)
    with tempfile.TemporaryDirectory(dir=os.environ.get("MODELD_BENCH_TMP")) as d:
        path = os.path.join(d, "agent.snap")
        t0 = time.perf_counter()
        info = await reuse.snapshot("snap", path)
        write_s = time.perf_counter() - t0
        target = sibling(reuse, a.kv_mib, prefix_reuse=True)
        t0 = time.perf_counter()
        tr = await target.restore("r", path)
        restore_s = time.perf_counter() - t0
        f, out = await first_token(target, "r", a.gen)
        _, ref = await first_token(reuse, "snap", a.gen)
        res["restore"] = {"greedy_tokens_agree": agree(out, ref),"tokens": len(last), "file_bytes": info["bytes"], "snapshot_write_s": write_s,
                          "restore_s": restore_s, "restore_ms_trace": tr.restore_ms,
                          "restore_first_output_s": restore_s + f,
                          "recompute_first_output_s": res["turns"][-1]["recompute_first_output_s"],
                          "speedup": res["turns"][-1]["recompute_first_output_s"] / (restore_s + f)}
    res["loadavg_end"] = os.getloadavg()
    with open("/proc/self/status") as fh:
        res["peak_rss_mib"] = next(int(ln.split()[1]) // 1024 for ln in fh if ln.startswith("VmHWM:"))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)

    print(f"\nmodeld agent replay: weights {res['weights_dtype']}, kv {res['kv_dtype']}, {res['threads']} threads, "
          f"torch {res['torch']}, load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f} (shared machine)")
    print(f"{'turn':>4} {'context':>7} {'new':>5} {'reuse s':>8} {'floor s':>8} {'recompute s':>11} {'speedup':>8} "
          f"{'reuse/floor':>11}")
    for r in res["turns"]:
        print(f"{r['turn']:>4} {r['context']:>7} {r['new_tokens']:>5} {r['reuse_first_output_s']:>8.2f} "
              f"{r.get('floor_first_output_s', float('nan')):>8.2f} {r['recompute_first_output_s']:>11.2f} "
              f"{r['speedup']:>7.1f}x {r.get('reuse_over_floor', float('nan')):>10.2f}x")
    tot = res["replay_total_s"]
    print(f"replay total (all turns, {a.gen} tokens each): reuse {tot['reuse']:.1f} s, recompute {tot['recompute']:.1f} s")
    if "branch" in res:
        b = res["branch"]
        print(f"branch at turn {b['at_turn']} ({b['context']} tokens, {b['reuse']['tokens_reused']} reused): "
              f"{b['reuse_first_output_s']:.2f} s vs cold {b['recompute_first_output_s']:.2f} s ({b['speedup']:.1f}x)")
    rs = res["restore"]
    print(f"restore {rs['tokens']} tokens from {rs['file_bytes'] / 2**20:.1f} MiB: {rs['restore_s'] * 1e3:.0f} ms "
          f"(+ first token: {rs['restore_first_output_s']:.2f} s) vs recompute {rs['recompute_first_output_s']:.2f} s "
          f"({rs['speedup']:.1f}x); snapshot write {rs['snapshot_write_s'] * 1e3:.0f} ms")
    agreed = [r["greedy_tokens_agree"] for r in res["turns"]]
    print(f"greedy tokens, reuse vs recompute, per turn: {' '.join(agreed)}; branch "
          f"{res.get('branch', {}).get('greedy_tokens_agree')}; restore vs source {rs['greedy_tokens_agree']}")
    print(f"peak RSS {res['peak_rss_mib']} MiB; JSON: {a.out}")
    for e in (reuse, cold, target):
        e.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
