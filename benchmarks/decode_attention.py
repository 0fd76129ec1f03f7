"""What exact reuse costs in a decode step's attention, on this CPU: one layer's attention of one decoded row of
SmolLM2-135M's shape (9 query heads over 3 KV heads of 64), timed as the cell computes it and as one flash call.

  * ``segmented``: model.segmented_row, what a one-session decode step runs: the keys cut at absolute multiples of
    512, one flash call over the full segments, one over the open segment zero-padded to 512 keys (masked), and the
    merge of their LSEs; every row gets the bits a prefill of it computes (docs/reuse.md, "Exactness");
  * ``one-call``: one flash call over all the keys, unpadded: what the recomputing decode step runs
    (MODELD_DECODED_KV=recompute; its bits differ from a prefill's, and the next prefill computes the tokens again);
  * ``cpu_kernel``: kernels/paged_decode/cpu.c (built here with the machine's C compiler), the recomputing step's
    attention where MODELD_CPU_KERNELS serves it: the row read in place from a paged cache of 16-token blocks through
    a consecutive block table (``cpu_kernel``) and a shuffled one (``cpu_kernel_scattered``).

Each timing cycles through --copies distinct layers' K/V (30: SmolLM2's layers), as a decode step reads each layer's
keys once: with one copy the keys stay in the CPU's cache between calls and the figure is a warm one.

It also counts, per padding granularity P, the open-segment lengths (1..512 keys) at which padding to the next
multiple of P instead of to 512 changes the flash call's output or LSE bits (random inputs, seeded): whether the
padding could be shortened without losing exactness.

    .venv/bin/python benchmarks/decode_attention.py --out docs/bench/DATE/decode_attention.json

Figures vary by CPU and by what else runs: the JSON records the CPU, torch and the load average.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--copies", type=int, default=30, help="distinct layers' K/V each timing cycles through")
    ap.add_argument("--no-padding", action="store_true", help="skip the padding count")
    ap.add_argument("--out", default="_out/decode_attention.json")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "cellimage"))
    import torch

    from modeld_cell import model as M
    from modeld_cell.kernels.paged_decode import cpu
    from modeld_cell.profile_gate import hardware

    build = cpu.load(None)
    print(f"cpu kernel: {build['reason']}", flush=True)

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
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copies": a.copies,
                 "cpu_kernel_build": build, "timings_us": {}, "padding": {}}
    for name in a.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        causal, zeros = M._causal_rows(seg, dt, torch.device("cpu")), M._zeros(hkv, seg, d, dt, torch.device("cpu"))
        q = torch.randn(1, hq, d, generator=g).to(dt)
        qq = q.view(1, hkv, hq // hkv, d)
        qq = torch.cat([qq, qq[:, :, -1:].expand(1, hkv, rows - hq // hkv, d)], 2)
        res = {}
        for n in (int(x) for x in a.contexts.split(",")):
            bs, c = 16, a.copies
            nblk = -(-n // bs)
            pools = [(torch.randn(nblk + 2, bs, hkv, d, generator=g).to(dt),
                      torch.randn(nblk + 2, bs, hkv, d, generator=g).to(dt)) for _ in range(c)]
            flat = [(kc.view(-1, hkv, d)[:n], vc.view(-1, hkv, d)[:n]) for kc, vc in pools]
            heads = [(k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)) for k, v in flat]
            straight = torch.arange(nblk, dtype=torch.int32)
            shuffled = torch.randperm(nblk + 2, generator=g)[:nblk].to(torch.int32)

            def each(fn) -> float:  # noqa: ANN001
                i = [0]

                def one() -> None:
                    fn(i[0] % a.copies)
                    i[0] += 1
                return us(one)

            res[str(n)] = {
                "segmented": each(lambda j: M.segmented_row(q, *flat[j], n - 1, scale, seg, causal, zeros)),  # noqa: B023
                "one_call": each(lambda j: flash(qq, *heads[j], scale=scale)),                                # noqa: B023
            }
            if build["loaded"]:
                for key, table in (("cpu_kernel", straight), ("cpu_kernel_scattered", shuffled)):
                    res[str(n)][key] = each(lambda j: torch.ops.modeld.paged_decode_cpu(  # noqa: B023
                        q, *pools[j], table, n, scale))                                                   # noqa: B023
            print(f"{name} {n:5d} keys: " + ", ".join(f"{k} {v:7.1f} us" for k, v in res[str(n)].items()),
                  flush=True)
        out["timings_us"][name] = res
        if a.no_padding:
            continue
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
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchjson import write
    write(out, a.out)


if __name__ == "__main__":
    main()
