"""Where the int4 error comes from: fake-quant (quantize -> dequantize, rotated basis) into an fp32 KV cache,
K only / V only / both / both with the first prompt row kept exact. Seeds and variant as exp.py.

    OMP_NUM_THREADS=1 PYTHONPATH=cellimage python benchmarks/int4_diag.py --variant base --seeds 4
"""
import argparse
import asyncio
import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import int4_variants as exp  # noqa: E402
from int4_variants import P, R, quality  # noqa: E402

from modeld_cell import kv_cache as KVC  # noqa: E402

ORIG_WRITE = KVC.PagedKVCache.write
MODE = {"k": True, "v": True, "sink": False, "qdq": None}


def fq(x, first_exact):
    q, s = MODE["qdq"][0](R.rotate(x.float()), "int4")
    y = R.unrotate(MODE["qdq"][1](q, s, "int4")).to(x.dtype)
    if first_exact and x.shape[0] > 1:
        y[0] = x[0]
    return y


def write(self, layer, k, v, slots):
    if getattr(self, '_fq', False):
        if MODE["k"]:
            k = fq(k, MODE["sink"])
        if MODE["v"]:
            v = fq(v, MODE["sink"])
    return ORIG_WRITE(self, layer, k, v, slots)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="base")
    ap.add_argument("--seeds", default="4")
    ap.add_argument("--modes", default="kv,k,v,kv-sink")
    ap.add_argument("--out", default="_out/int4_diag.jsonl")
    a = ap.parse_args()
    exp.start_jsonl(a.out)
    V = exp.variants()
    KVC.PagedKVCache.write = write
    base = P.Engine.from_cell(P.SPEC)
    for seed in [int(s) for s in a.seeds.split(",")]:
        R.ROTATION_SEED = seed
        R.rotation_signs.cache_clear()
        MODE["qdq"] = V[a.variant]
        for m in a.modes.split(","):
            MODE.update(k="k" in m.split("-")[0], v="v" in m.split("-")[0], sink=m.endswith("-sink"))
            e = P.engine_like(base, "fp32")
            e.kv._fq = True
            r = await quality.quality_smoke(e, base)
            e.shutdown()
            row = {"diag": m, "variant": a.variant, "seed": seed, "agreement": r["greedy_agreement"],
                   "kl_mean": r["kl_mean"], "kl_max": r["kl_max"], "failures": quality.check("int4", r)}
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    base.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
