"""int4 KV variants x rotation seeds on the real quality smoke (SmolLM2-135M, CPU, fp32 weights).

Every variant keeps the int4 storage exactly: uint8 [.., D // 2] nibbles + fp16 [.., D // 32] "scales" (2 fp16 per
64-value head vector = 4 bytes), so bytes/token stay 6,480. Patched: quant_ref.quantize (kv_cache.write) and
model.dequantize (the CPU attention reads), quant_ref.ROTATION_SEED (+ rotation_signs.cache_clear()).

    OMP_NUM_THREADS=1 PYTHONPATH=cellimage python benchmarks/int4_variants.py \
        --variants base,nf4 --seeds 1,2,3,4 --out _out/int4_variants.jsonl

An experiment, not a served format: docs/kernels.md ("Why int4 fails") quotes its results.
"""
import argparse
import asyncio
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profiles_cpu as P  # noqa: E402

from modeld_cell import model as M  # noqa: E402
from modeld_cell import quality  # noqa: E402
from modeld_cell.kernels.quant_kv import reference as R  # noqa: E402

ORIG_Q, ORIG_DQ = R.quantize, R.dequantize
FI = torch.finfo(torch.float16)


def fp16_scale(s):
    """|s| clamped to fp16 normal range, sign kept, 0 stays 0."""
    a = s.abs().float().clamp(FI.tiny, FI.max)
    out = (torch.sign(s) * a).to(torch.float16)
    return torch.where(s != 0, out, torch.zeros_like(out))


def nearest(y, levels):
    """index of the nearest level (levels sorted ascending) for y."""
    mids = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(y, mids)


def pack(idx, shape):
    v = idx.to(torch.uint8).reshape(shape)
    return v[..., 0::2] | (v[..., 1::2] << 4)


def unpack(q):
    lo, hi = (q & 0xF).long(), (q >> 4).long()
    return torch.stack([lo, hi], -1).reshape(*q.shape[:-1], 2 * q.shape[-1])


# ---------------------------------------------------------------- codebooks
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def lloyd(fixed_top: bool, n_free: int, signed: bool, group: int = 32, n: int = 60_000, it: int = 80):
    """Symmetric Lloyd-Max levels on |y| for the non-max elements of Gaussian groups normalized by their absmax.
    Levels on |y|: 0 (fixed), n_free free, and 1 (fixed when fixed_top). Returns sorted 16-entry codebook."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, group, generator=g, dtype=torch.float64)
    am = x.abs().amax(-1, keepdim=True)
    y = (x / am).abs().flatten()
    y = y[y < 1 - 1e-12]                                   # drop the max element (exact at +-1)
    lv = torch.linspace(0, 1, n_free + 2, dtype=torch.float64)[1:-1] if fixed_top else \
        torch.linspace(0, 1, n_free + 1, dtype=torch.float64)[1:]
    for _ in range(it):
        full = torch.cat([torch.zeros(1, dtype=torch.float64), lv] + ([torch.ones(1, dtype=torch.float64)] if fixed_top else []))
        idx = nearest(y, full)
        new = lv.clone()
        for j in range(len(lv)):
            sel = y[idx == j + 1]
            if len(sel):
                new[j] = sel.mean()
        lv = new
    pos = lv.float()
    if signed:     # {-b7..-b1, 0, b1..b7, +1}: the max element (scale carries its sign) is exactly +1
        return torch.cat([-pos.flip(0), torch.zeros(1), pos, torch.ones(1)])
    # {-1, -a6..-a1, 0, a1..a6, 1} + a spare duplicate of 0 -> 16 entries, sorted
    return torch.cat([-torch.ones(1), -pos.flip(0), torch.zeros(2), pos, torch.ones(1)])


# ---------------------------------------------------------------- variant factories
def make_sym(levels, group=32, clips=(1.0,), signed=False):
    """scale s = r * absmax (signed: r * the max element, sign included) in fp16; value = levels[idx] * s.
    levels: 16 sorted normalized levels (max |.| = 1). clips: per-group search, min SSE."""
    levels = levels.float()
    assert len(levels) == 16

    def quantize(x, fmt):
        if fmt != "int4":
            return ORIG_Q(x, fmt)
        D = x.shape[-1]
        xf = x.float().reshape(*x.shape[:-1], D // group, group)
        am = xf.abs().amax(-1)
        if signed:
            top = torch.gather(xf, -1, xf.abs().argmax(-1, keepdim=True)).squeeze(-1)
        else:
            top = am
        best_err, best_s, best_idx = None, None, None
        for r in clips:
            s = fp16_scale(top * r)
            div = torch.where(s != 0, s.float(), 1.0).unsqueeze(-1)
            idx = nearest(xf / div, levels)
            err = ((levels[idx] * s.float().unsqueeze(-1) - xf) ** 2).sum(-1)
            if best_err is None:
                best_err, best_s, best_idx = err, s, idx
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_s = torch.where(better, s, best_s)
                best_idx = torch.where(better.unsqueeze(-1), idx, best_idx)
        # zero group: idx of level 0 (any idx dequantizes to 0 with scale 0)
        scale = best_s.reshape(*x.shape[:-1], D // group)
        return pack(best_idx, x.shape), scale

    def dequantize(q, scale, fmt=None):
        fmt = fmt or R.format_of(q)
        if fmt != "int4":
            return ORIG_DQ(q, scale, fmt)
        v = levels[unpack(q)]
        D = v.shape[-1]
        sc = scale.float()[..., : D // group]
        return (v.reshape(*v.shape[:-1], D // group, group) * sc.unsqueeze(-1)).reshape(v.shape)

    return quantize, dequantize


def make_asym(group=64, clips=(1.0,)):
    """min/max group quantization: s = (max - min) / 15, z = min, both fp16 in the 2 scale slots (group 64)."""
    def quantize(x, fmt):
        if fmt != "int4":
            return ORIG_Q(x, fmt)
        D = x.shape[-1]
        assert D == 64 and group == 64
        xf = x.float().reshape(*x.shape[:-1], 1, group)
        mn, mx = xf.amin(-1), xf.amax(-1)
        best = None
        for r in clips:   # shrink the range symmetrically about its centre
            c = (mx + mn) / 2
            lo, hi = c + (mn - c) * r, c + (mx - c) * r
            z = lo.to(torch.float16)
            s = fp16_scale((hi - z.float()) / 15)
            div = torch.where(s != 0, s.float(), 1.0).unsqueeze(-1)
            idx = torch.round((xf - z.float().unsqueeze(-1)) / div).clamp(0, 15)
            err = ((idx * s.float().unsqueeze(-1) + z.float().unsqueeze(-1) - xf) ** 2).sum(-1)
            if best is None:
                best = (err, s, z, idx)
            else:
                b = err < best[0]
                best = (torch.where(b, err, best[0]), torch.where(b, s, best[1]), torch.where(b, z, best[2]),
                        torch.where(b.unsqueeze(-1), idx, best[3]))
        _, s, z, idx = best
        return pack(idx.long(), x.shape), torch.cat([s, z], -1).reshape(*x.shape[:-1], 2)

    def dequantize(q, scale, fmt=None):
        fmt = fmt or R.format_of(q)
        if fmt != "int4":
            return ORIG_DQ(q, scale, fmt)
        v = unpack(q).float()
        s, z = scale.float()[..., 0:1], scale.float()[..., 1:2]
        return v * s + z

    return quantize, dequantize


UNI15 = torch.arange(-8, 8).float() / 7          # baseline grid (code 0 = -8/7 never chosen)
UNI16S = torch.arange(-7, 9).float() / 8         # signed scale: all 16 levels, max element = +8 steps
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8)


def variants():
    lm_u = lloyd(fixed_top=True, n_free=6, signed=False)
    lm_s = lloyd(fixed_top=True, n_free=7, signed=True)
    return {
        "base": (ORIG_Q, ORIG_DQ),
        "uni15": make_sym(UNI15),                                  # should equal base (sanity)
        "uni15-clip": make_sym(UNI15, clips=CLIPS),
        "uni16-signed": make_sym(UNI16S, signed=True),
        "uni16-signed-clip": make_sym(UNI16S, signed=True, clips=CLIPS),
        "nf4": make_sym(NF4),
        "nf4-clip": make_sym(NF4, clips=CLIPS),
        "nf4-signed": make_sym(NF4, signed=True),
        "lloyd": make_sym(lm_u),
        "lloyd-signed": make_sym(lm_s, signed=True),
        "lloyd-signed-clip": make_sym(lm_s, signed=True, clips=CLIPS),
        "asym64": make_asym(),
        "asym64-clip": make_asym(clips=CLIPS),
        # over budget, diagnostics only (diag.py fake-quant path): group 16 = 4 fp16 scales per 32 values
        "uni15-g16": make_sym(UNI15, group=16),
        "uni15-g16-clip": make_sym(UNI15, group=16, clips=CLIPS),
    }


def start_jsonl(path: str) -> None:
    """A fresh JSON-lines file whose first line says what made it: the command, the machine, the time."""
    from datetime import datetime, timezone

    from modeld_cell.profile_gate import hardware

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"command": "python " + " ".join(sys.argv), "hardware": hardware(),
                            "threads": torch.get_num_threads(),
                            "started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}, default=str) + "\n")


def install(qdq, seed):
    R.quantize, M.dequantize = qdq
    R.ROTATION_SEED = seed
    R.rotation_signs.cache_clear()


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base")
    ap.add_argument("--seeds", default="1,2,3,4")
    ap.add_argument("--out", default="_out/int4_variants.jsonl")
    ap.add_argument("--mse", action="store_true", help="only print the synthetic Gaussian MSE per variant")
    a = ap.parse_args()
    V = variants()
    names = list(V) if a.variants == "all" else a.variants.split(",")
    if a.mse:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4096, 3, 64, generator=g)
        for n in names:
            q, s = V[n][0](x, "int4")
            e = ((V[n][1](q, s, "int4") - x) ** 2).mean()
            print(f"{n:22s} gaussian rel MSE {float(e):.5f}")
        return
    start_jsonl(a.out)
    base = P.Engine.from_cell(P.SPEC)
    for seed in [int(s) for s in a.seeds.split(",")]:
        for n in names:
            install(V[n], seed)
            t = time.time()
            e = P.engine_like(base, "int4")
            r = await quality.quality_smoke(e, base)
            e.shutdown()
            row = {"variant": n, "seed": seed, "agreement": r["greedy_agreement"], "kl_mean": r["kl_mean"],
                   "kl_max": r["kl_max"], "free_run": r["free_run_match"], "capital": r["capital"]["ok"],
                   "passkey": r["passkey"]["ok"], "bytes_per_token": e.kv.bytes_per_token,
                   "failures": quality.check("int4", r), "s": round(time.time() - t, 1)}
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    install((ORIG_Q, ORIG_DQ), 4)
    base.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
