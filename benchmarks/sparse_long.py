"""Block-sparse vs dense prefill end to end in the CPU worker: real SmolLM2-135M-Instruct (bf16 weights, bf16 KV),
long real text (Python standard-library sources), through the Engine.

For each --contexts length, side by side in one run (dense first, then sparse, per length):
  * time to first output: ensure_prefix of the whole prompt plus the first greedy token, for the dense cell (the
    production path: 512-token chunks, segmented flash) and the block-sparse cell (one chunk, vertical-slash
    estimate per layer at the worker's defaults, block-sparse flash attention),
  * the sparse run's layers that ran sparse, mean block density, and the seconds spent in
    ``kernels.dispatch.sparse_prefill`` (estimate + sparse attention, all layers; the rest is the projection and MLP
    work both cells do),
  * next-token KL (dense || sparse) at the prompt end and greedy agreement of --gen tokens.
Lengths above the model's 8,192 trained positions run with linear RoPE scaling (factor length / 8192) in both
cells: that is for timing only, the issue judges quality at up to 8k; their KL and agreement are printed but are
not a quality claim. Writes JSON (--out) and prints one line per length.

    PYTHONPATH=cellimage python benchmarks/sparse_long.py --contexts 8000,16384,32768 --out _out/sparse_long.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import math
import os
import platform
import sys
import time

import torch
from profiles_cpu import kl

from modeld_cell import model as model_mod
from modeld_cell.engine import CellConfig, Engine, EngineSettings, SamplingParams
from modeld_cell.kernels.quant_kv import reference as quant_ref
from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.models.fetch import SMOLLM2_REF

SPEC = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
        "profile": {"weights": "bf16", "kv": "bf16", "attention": "dense", "prefixReuse": True},
        "contextTier": 8192, "kvMemoryMiB": 64}
CORPUS = ("typing", "logging", "argparse", "inspect", "dataclasses", "pathlib", "subprocess", "collections",
          "functools", "threading", "asyncio.tasks", "asyncio.base_events", "email.message", "json.decoder")


def corpus_ids(eng: Engine, n: int) -> list[int]:
    """At least n tokens of real text: standard-library module sources, in CORPUS order."""
    ids: list[int] = []
    for name in CORPUS:
        ids += eng.tokenizer.encode(open(inspect.getsourcefile(importlib.import_module(name))).read())  # type: ignore[arg-type]
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the corpus holds {len(ids)} tokens, fewer than {n}")


def cell(base: Engine, attention: str, tier: int) -> Engine:
    """An engine on base's weights with its own KV pool sized for ``tier`` tokens."""
    spec = {**SPEC, "contextTier": tier, "profile": {**SPEC["profile"], "attention": attention}}
    cfg = CellConfig.from_spec(spec)
    a = base.model.args
    fmt = kv_format(cfg.kv)
    per_token = quant_ref.bytes_per_token(fmt.quant or fmt.name, a.n_layers, a.n_kv_heads, a.head_dim)
    budget = (tier + 256) * per_token + (64 << 20)
    cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, fmt, budget)
    return Engine(base.model, base.tokenizer, cache, cfg, dict(base.identity), EngineSettings.from_env())


def set_rope(base: Engine, length: int, trained: int, original: dict | None) -> float:
    """Linear RoPE scaling so that ``length`` positions fit the trained range (factor 1: the model as trained)."""
    a = base.model.args
    factor = max(1.0, length / trained)
    a.rope_scaling = original if factor == 1.0 else {"type": "linear", "factor": factor}
    base.model.init_rope()
    return factor


async def first_output(eng: Engine, sid: str, ids: list[int], gen: int) -> tuple[float, list[int], torch.Tensor]:
    """Seconds from the request to the first generated token, the greedy tokens, the next-token logits."""
    eng.clear_prefix_cache()
    t0 = time.perf_counter()
    await eng.ensure_prefix(sid, ids)
    logits = eng.next_token_logits(sid)
    out: list[int] = []
    ttft = math.nan
    async for ev in eng.decode(sid, SamplingParams(), gen, stop_token_ids=[]):
        if ev.done:
            continue
        if not out:
            ttft = time.perf_counter() - t0
        out.append(ev.token_id)
    eng.close_session(sid)
    return ttft, out, logits


class AttentionClock:
    """Wraps the model's ``dispatch.sparse_prefill`` to add up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = model_mod.dispatch.sparse_prefill
        model_mod.dispatch.sparse_prefill = self  # type: ignore[assignment]

    def __call__(self, *a, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return self._inner(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="8000,16384,32768")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--out", default="_out/sparse_long.json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.contexts.split(",")]
    t0 = time.time()
    base = Engine.from_cell(SPEC)
    a = base.model.args
    trained, original = a.max_seq_len, a.rope_scaling
    a.max_seq_len = max(trained, max(lengths) + args.gen)
    base.model.init_rope()
    tier = a.max_seq_len
    dense, sparse = cell(base, "dense", tier), cell(base, "block-sparse", tier)
    corpus = corpus_ids(base, max(lengths))
    st = sparse.settings
    clock = AttentionClock()
    out: dict = {"meta": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                          "python": sys.version.split()[0], "machine": platform.machine(),
                          "loadavg_1m_start": os.getloadavg()[0],
                          "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
                          "command": " ".join(["python"] + sys.argv),
                          "weights": "bf16", "kv": "bf16", "corpus": list(CORPUS),
                          "sparse_settings": {"min_tokens": st.sparse_min_tokens, "keep_ratio": st.sparse_keep_ratio,
                                              "max_keep_tokens": st.sparse_max_keep_tokens,
                                              "max_density": st.sparse_max_density},
                          "dense_prefill_chunk": dense.settings.prefill_chunk},
                 "rows": []}
    for n in lengths:
        factor = set_rope(base, n, trained, original)
        ids = corpus[:n]
        d_s, d_ids, d_logits = await first_output(dense, f"d{n}", ids, args.gen)
        clock.seconds = 0.0
        s_s, s_ids, s_logits = await first_output(sparse, f"s{n}", ids, args.gen)
        attn_s = clock.seconds
        last = sparse.capability()["attention"]["sparse"]["last_chunk"]
        dens = last["densities"]
        row = {"tokens": n, "rope_linear_factor": factor, "quality_judged": factor == 1.0,
               "dense_first_output_s": round(d_s, 2), "sparse_first_output_s": round(s_s, 2),
               "speedup": round(d_s / s_s, 2), "sparse_attention_s": round(attn_s, 2),
               "sparse_layers": f"{last['sparse_layers']}/{last['layers']}",
               "density_mean": round(sum(dens) / len(dens), 3) if dens else None,
               "next_token_kl": round(kl(d_logits, s_logits), 5),
               f"greedy_match_{args.gen}": sum(x == y for x, y in zip(d_ids, s_ids, strict=True)) / args.gen,
               "loadavg_1m": os.getloadavg()[0]}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    out["meta"]["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for e in (dense, sparse, base):
        e.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
