"""What exact reuse costs in a decode step's attention, on this CPU: one layer's attention of one decoded row of
SmolLM2-135M's shape (9 query heads over 3 KV heads of 64), timed as the cell computes it and as one flash call.

  * ``segmented``: model.segmented_row, what a one-session decode step runs: the keys cut at absolute multiples of
    512, one flash call over the full segments, one over the open segment zero-padded to 512 keys (masked), and the
    merge of their LSEs; every row gets the bits a prefill of it computes (docs/reuse.md, "Exactness");
  * ``one-call``: one flash call over all the keys, unpadded: what a decode kernel without that promise could run
    (its bits differ from a prefill's; reported, never served).

It also counts, per padding granularity P, the open-segment lengths (1..512 keys) at which padding to the next
multiple of P instead of to 512 changes the flash call's output or LSE bits (random inputs, seeded): whether the
padding could be shortened without losing exactness.

    .venv/bin/python benchmarks/decode_attention.py --out docs/bench/DATE/decode_attention.json

Figures vary by CPU and by what else runs: the JSON records the CPU, torch and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1025,2049,4097,8193", help="keys attended (tokens cached + the new one)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--calls", type=int, default=300, help="calls per timing (median of --rounds)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (a one-session step often runs at 1)")
    ap.add_argument("--out", default="_out/decode_attention.json")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "cellimage"))
    import torch

    from modeld_cell import model as M
    from modeld_cell.profile_gate import hardware

    torch.set_num_threads(a.threads)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    hq, hkv, d, seg = 9, 3, 64, M.ATTN_SEGMENT
    rows = hq // hkv + (-(hq // hkv)) % 4
    scale = 1.0 / d ** 0.5
    g = torch.Generator().manual_seed(0)

    def us(fn) -> float:  # noqa: ANN001
        for _ in range(20):
            fn()
        per = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            for _ in range(a.calls):
                fn()
            per.append((time.perf_counter() - t) / a.calls * 1e6)
        return round(statistics.median(per), 1)

    out: dict = {"command": " ".join(["decode_attention.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
                 "threads": a.threads, "loadavg_start": round(os.getloadavg()[0], 2),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timings_us": {},
                 "padding": {}}
    for name in a.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        causal, zeros = M._causal_rows(seg, dt, torch.device("cpu")), M._zeros(hkv, seg, d, dt, torch.device("cpu"))
        q = torch.randn(1, hq, d, generator=g).to(dt)
        qq = q.view(1, hkv, hq // hkv, d)
        qq = torch.cat([qq, qq[:, :, -1:].expand(1, hkv, rows - hq // hkv, d)], 2)
        res = {}
        for n in (int(x) for x in a.contexts.split(",")):
            k = torch.randn(n, hkv, d, generator=g).to(dt)
            v = torch.randn(n, hkv, d, generator=g).to(dt)
            kk, vv = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
            res[str(n)] = {
                "segmented": us(lambda: M.segmented_row(q, k, v, n - 1, scale, seg, causal, zeros)),  # noqa: B023
                "one_call": us(lambda: flash(qq, kk, vv, scale=scale)),                               # noqa: B023
            }
            print(f"{name} {n:5d} keys: segmented {res[str(n)]['segmented']:7.1f} us, one call "
                  f"{res[str(n)]['one_call']:7.1f} us", flush=True)
        out["timings_us"][name] = res
        # padding the open segment to a multiple of P keys instead of to 512: which lengths change the bits
        q4 = torch.randn(1, hkv, rows, d, generator=g).to(dt)
        kf = torch.randn(1, hkv, seg, d, generator=g).to(dt)
        vf = torch.randn(1, hkv, seg, d, generator=g).to(dt)
        pads = {}
        for p in (16, 32, 64, 128, 256):
            differ = []
            for length in range(1, seg + 1):
                kz, vz = torch.zeros_like(kf), torch.zeros_like(vf)
                kz[:, :, :length], vz[:, :, :length] = kf[:, :, :length], vf[:, :, :length]
                mask = causal[length - 1 : length].expand(rows, seg)[None, None]
                o, lse = flash(q4, kz, vz, attn_mask=mask, scale=scale)[:2]
                lp = min(seg, -(-length // p) * p)
                o2, lse2 = flash(q4, kz[:, :, :lp], vz[:, :, :lp], attn_mask=mask[..., :lp], scale=scale)[:2]
                if not (torch.equal(o, o2) and torch.equal(lse, lse2)):
                    differ.append(length)
            pads[str(p)] = {"lengths_whose_bits_differ": len(differ), "first": differ[:8]}
            print(f"{name} padding to a multiple of {p}: {len(differ)} of {seg} lengths differ", flush=True)
        out["padding"][name] = pads
    out["loadavg_end"] = round(os.getloadavg()[0], 2)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
