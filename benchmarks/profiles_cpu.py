"""Serving profiles on the CPU torch path, real SmolLM2-135M-Instruct (fp32 weights), through the Engine.

Measures
  * KV capacity per precision (fp32, bf16, int8, fp8-e4m3, int4): bytes/token (fp16 scales included) and tokens
    that fit at --kv-mib, (whether a lossy format is served is the worker's own measurement at start, profile_gate.py),
  * decode ms/token after a --decode-ctx prefill per precision (median of --decode-tokens steps),
  * ``modeld_cell.quality.quality_smoke`` of int8 / fp8-e4m3 / int4 against the fp32-KV dense engine, and of
    block-sparse forced on a short passkey prompt (min tokens 64, no density cut-off), with the PROFILE_THRESHOLDS
    verdict on this machine,
  * block-sparse at the default settings on real text at --sparse-contexts tokens: prefill time dense vs sparse,
    mean block density, next-token KL at the prompt end and greedy agreement of 16 generated tokens.
Writes JSON (--out) and prints it. --sections and --kv run a subset (the 2-core CI box takes minutes per smoke);
--rotate names the quantized formats stored Hadamard-rotated for this run (default: the format's own,
``quant_kv.reference.ROTATED_FORMATS``; "" for none), to measure the rotation's effect on each format.

    PYTHONPATH=cellimage python benchmarks/profiles_cpu.py --out _out/profiles_cpu.json
    PYTHONPATH=cellimage python benchmarks/profiles_cpu.py --sections quality --kv int4 --out _out/int4.json
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

from modeld_cell import quality
from modeld_cell.engine import Engine, EngineSettings, SamplingParams
from modeld_cell.kernels.quant_kv import reference as quant_ref
from modeld_cell.models.fetch import SMOLLM2_REF

SPEC = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
        "profile": {"weights": "fp32", "kv": "fp32", "attention": "dense", "prefixReuse": True},
        "contextTier": 8192, "kvMemoryMiB": 512}


def engine_like(base: Engine, kv: str = "fp32", attention: str = "dense", kv_mib: int = 512,
                **settings: object) -> Engine:
    """A second engine on base's weights with its own KV pool, profile and settings (no quality gate: this script
    measures what the gate would decide)."""
    st = EngineSettings(threads=torch.get_num_threads(), **settings)  # type: ignore[arg-type]
    return base.sibling(kv=kv, attention=attention, kv_mib=kv_mib, settings=st)


def corpus_ids(eng: Engine) -> list[int]:
    import logging
    import typing
    text = "\n".join(open(inspect.getsourcefile(m)).read() for m in (logging, typing))  # type: ignore[arg-type]
    return eng.tokenizer.encode(text)


async def greedy(eng: Engine, sid: str, n: int) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    per: list[float] = []
    async for ev in eng.decode(sid, SamplingParams(), n, stop_token_ids=[]):
        if ev.done:
            per = ev.trace.decode_ms_per_token
        else:
            ids.append(ev.token_id)
    return ids, per


def kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--decode-ctx", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--sparse-contexts", default="4096,8000")  # + 16 generated <= tier 8192
    ap.add_argument("--sections", default="capacity,quality,sparse")
    ap.add_argument("--kv", default="fp32,bf16,int8,fp8-e4m3,int4")
    ap.add_argument("--rotate", default=None, help="comma list of quant formats (int8,fp8,int4) stored rotated")
    ap.add_argument("--out", default="_out/profiles_cpu.json")
    args = ap.parse_args()
    sections, kvs = args.sections.split(","), args.kv.split(",")
    if args.rotate is not None:
        quant_ref.ROTATED_FORMATS = frozenset(f for f in args.rotate.split(",") if f)
    t0 = time.time()
    base = Engine.from_cell(SPEC)
    ids = corpus_ids(base)
    out: dict = {"meta": {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
                          "machine": platform.machine(), "loadavg_start": os.getloadavg()[0],
                          "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), "argv": sys.argv[1:],
                          "kv_scale_dtype": str(quant_ref.SCALE_DTYPE).removeprefix("torch."),
                          "rotated_formats": sorted(quant_ref.ROTATED_FORMATS)},
                 "capacity": {}, "decode": {}, "quality": {}, "sparse": []}

    for kv in [k for k in kvs if "capacity" in sections]:
        e = engine_like(base, kv, kv_mib=args.kv_mib)
        c = e.capability()["kv"]
        out["capacity"][kv] = {"bytes_per_token": c["bytes_per_token"], "kv_mib": args.kv_mib,
                               "max_tokens_in_budget": c["max_tokens_in_budget"], "scales": c["scales"]}
        await e.ensure_prefix("d", ids[: args.decode_ctx])
        _, per = await greedy(e, "d", args.decode_tokens)
        out["decode"][kv] = {"context": args.decode_ctx, "ms_per_token_median": round(statistics.median(per), 2)}
        e.shutdown()
    bf16 = out["capacity"].get("bf16", {}).get("max_tokens_in_budget")
    for c in out["capacity"].values():
        c["vs_bf16"] = round(c["max_tokens_in_budget"] / bf16, 3) if bf16 else None

    for kv in [k for k in kvs if "quality" in sections and k in ("int8", "fp8-e4m3", "int4")]:
        e = engine_like(base, kv)
        r = await quality.quality_smoke(e, base)
        out["quality"][kv] = {**r, "failures": quality.check(kv, r)}
        e.shutdown()
    if "sparse" in sections:
        await sparse_rows(base, ids, args, out)
    out["meta"]["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    base.shutdown()


async def sparse_rows(base: Engine, ids: list[int], args: argparse.Namespace, out: dict) -> None:
    """The forced block-sparse quality smoke and the default-settings sparse prefill rows."""
    e = engine_like(base, attention="block-sparse", sparse_min_tokens=64, sparse_max_density=1.0)
    r = await quality.quality_smoke(e, base, prompts=quality.LONG_PROMPTS, n_tokens=24, passkey_repeats=14)
    out["quality"]["block-sparse (forced: min tokens 64, no density cut-off)"] = {
        **r, "failures": quality.check("block-sparse", r), "sparse": e.sparse_stats}
    e.shutdown()

    sp = engine_like(base, attention="block-sparse")
    for n in [int(x) for x in args.sparse_contexts.split(",")]:
        row: dict = {"tokens": n}
        for name, eng in (("dense", base), ("sparse", sp)):
            eng.clear_prefix_cache()
            t = time.perf_counter()
            tr = await eng.ensure_prefix(f"s{n}", ids[:n])
            row[f"{name}_prefill_s"] = round(time.perf_counter() - t, 2)
            row[f"{name}_logits"] = eng.next_token_logits(f"s{n}")
            row[f"{name}_ids"], _ = await greedy(eng, f"s{n}", 16)
            if name == "sparse":
                row["fallback"] = tr.fallback
                last = sp.capability()["attention"]["sparse"]["last_chunk"]
                d = last["densities"]
                row["sparse_layers"] = f"{last['sparse_layers']}/{last['layers']}"
                row["density_mean"] = round(sum(d) / len(d), 3) if d else None
            eng.close_session(f"s{n}")
        row["next_token_kl"] = round(kl(row.pop("dense_logits"), row.pop("sparse_logits")), 5)
        a, b = row.pop("dense_ids"), row.pop("sparse_ids")
        row["greedy_match_16"] = sum(x == y for x, y in zip(a, b, strict=True)) / 16
        out["sparse"].append(row)
    sp.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
