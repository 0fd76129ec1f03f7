"""A reused turn against its physical floor, repeated and interleaved so machine noise shows as spread, not as a
verdict (docs/reuse.md). agent_replay.py measures each turn once; this measures a few of its turns --repeats times.

For each chosen turn of agent_replay's transcript (stable prefix P = what the previous turn's prompt shares with this
one, suffix S = the rest), on one engine with prefixReuse on, each repeat runs in rotating order:

  in-session    ensure_prefix(P + S) on a session that holds exactly P: the contract's normal next turn
  cross-session ensure_prefix(P + S) on a NEW session: P's blocks come from the prefix index (copy-on-write of the
                partial last block), S is computed
  floor         prefill_suffix(S) on a session that holds exactly P: no lookup, no planning; only S's prefill

and each is followed by one decoded token (first output = request -> first token). Medians and min/max per path.

    PYTHONPATH=cellimage:api .venv/bin/python benchmarks/reuse_floor.py --out _out/reuse_floor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from agent_replay import build_prompts, first_token  # noqa: E402

from modeld_cell.config import cpu_compute_dtype
from modeld_cell.engine import Engine  # noqa: E402
from modeld_cell.models.fetch import SMOLLM2_REF
from modeld_cell.tokenizer import common_prefix  # noqa: E402


async def holding(eng: Engine, sid: str, ids: list[int]) -> None:
    """A session that holds exactly ids (its blocks come from the prefix index when cached)."""
    if sid in eng._sessions:
        eng.close_session(sid)
    await eng.ensure_prefix(sid, ids)


async def one(eng: Engine, path: str, past: list[int], full: list[int]) -> float:
    sid = f"m-{path}"
    if path == "cross-session":
        if sid in eng._sessions:
            eng.close_session(sid)
        t0 = time.perf_counter()
        tr = await eng.ensure_prefix(sid, full)
    else:
        await holding(eng, sid, past)
        t0 = time.perf_counter()
        if path == "in-session":
            tr = await eng.ensure_prefix(sid, full)
        else:
            tr = await eng.prefill_suffix(sid, full[len(past):])
    pre = time.perf_counter() - t0
    f, _ = await first_token(eng, sid, 1)
    new = len(full) - len(past)
    assert new <= tr.tokens_computed <= new + 1, (path, tr.tokens_computed, new)   # S computed, P reused
    eng.close_session(sid)
    eng.clear_prefix_cache()      # only P (held by the live "base" session) stays cached for the next repeat
    return pre + f


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default=cpu_compute_dtype(),
                    help="profile.weights (default: bf16 where the CPU computes it natively, else fp32)")
    ap.add_argument("--turns", default="3,9,11", help="agent_replay turn indices to measure")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="_out/reuse_floor.json")
    a = ap.parse_args()
    spec = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
            "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
            "profile": {"weights": a.weights, "kv": a.weights, "attention": "dense", "prefixReuse": True},
            "contextTier": 8192, "kvMemoryMiB": 1024}
    eng = Engine.from_cell(spec)
    prompts, _ = build_prompts(eng, 10, 740, 2)
    res: dict = {"command": " ".join(["python"] + sys.argv), "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
                 "weights_dtype": eng.config.weights, "kv_dtype": eng.config.kv, "turns": []}
    await holding(eng, "warm", prompts[0][:300])
    eng.close_session("warm")
    paths = ["in-session", "cross-session", "floor"]
    for i in (int(x) for x in a.turns.split(",")):
        full, prev = prompts[i], prompts[i - 1]
        past = full[: common_prefix(prev, full)]
        await holding(eng, "base", past)           # computes P once; its blocks stay cached for every repeat
        times: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(a.repeats):
            for p in paths[r % 3:] + paths[: r % 3]:   # rotate the order: no path always runs first
                times[p].append(await one(eng, p, past, full))
        eng.close_session("base")
        med = {p: statistics.median(v) for p, v in times.items()}
        row = {"turn": i, "context": len(full), "stable_prefix": len(past), "new_tokens": len(full) - len(past),
               "seconds": times, "median_s": med,
               "in_session_over_floor": med["in-session"] / med["floor"],
               "cross_session_over_floor": med["cross-session"] / med["floor"]}
        res["turns"].append(row)
        print(f"turn {i:2d} past {len(past):5d} new {row['new_tokens']:4d}: "
              + ", ".join(f"{p} {med[p]:.2f} s [{min(times[p]):.2f}-{max(times[p]):.2f}]" for p in paths)
              + f"; in-session/floor {row['in_session_over_floor']:.2f}, "
              f"cross-session/floor {row['cross_session_over_floor']:.2f}", flush=True)
    res["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    eng.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
