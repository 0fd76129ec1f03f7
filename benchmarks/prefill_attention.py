"""What a chunking-invariant prefill's attention costs on this CPU: one layer's attention of a chunk of new rows of
SmolLM2-135M's shape (9 query heads over 3 KV heads of 64) after a past, computed three ways:

  * ``rows``: kernels/paged_decode/cpu.c's row attention (built here with the machine's C compiler; AVX2+FMA), read
    in place from a paged cache of 16-token blocks through a block table; every row's bits are the same whatever
    rows share the call (docs/kernels.md, "The row attention");
  * ``segmented``: model._segmented_attention, the torch path it replaces where it serves: one flash call per 512-key
    segment and a merge of their LSEs, after the past is widened to the compute dtype, as model._attention does;
  * ``one_call``: one causal flash call over all the keys (an explicit mask for the offset): what torch computes when
    chunking invariance is not asked for (its bits depend on the chunk). A floor for torch, not a path the CPU cell
    serves.

Rows 1 is the exact decode step's attention (a prefill of one token); there ``segmented`` is model.segmented_row.

    .venv/bin/python benchmarks/prefill_attention.py --out docs/bench/DATE/prefill_attention.json

Figures vary by CPU and by what else runs: the JSON records the CPU, torch and the load average. Each timing is the
median of --rounds, the three ways alternated within a round.
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
    ap.add_argument("--pasts", default="0,1536,3584,7680", help="tokens cached before the chunk")
    ap.add_argument("--rows", default="512,1", help="new rows per call (512: a prefill chunk, 1: a decode row)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="_out/prefill_attention.json")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "cellimage"))
    import torch

    from modeld_cell import model as M
    from modeld_cell.kernels.paged_decode import cpu
    from modeld_cell.profile_gate import hardware

    build = cpu.load(None)
    print(f"cpu kernel: {build['reason']}; rows: {cpu.rows_refused(9, 3, 64) or 'serves 9/3/64'}", flush=True)
    if not build["loaded"] or cpu.rows_refused(9, 3, 64):
        raise SystemExit("the row attention does not serve on this machine: nothing to compare")
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    hq, hkv, d, bs = 9, 3, 64, 16
    scale = 1.0 / d ** 0.5
    g = torch.Generator().manual_seed(0)
    out: dict = {"command": " ".join(["prefill_attention.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
                 "loadavg_start": round(os.getloadavg()[0], 2), "cpu_kernel_build": build,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timings_ms": {}}
    for name in a.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        for threads in (int(x) for x in a.threads.split(",")):
            torch.set_num_threads(threads)
            for t in (int(x) for x in a.rows.split(",")):
                for past in (int(x) for x in a.pasts.split(",")):
                    n = past + t
                    nblk = -(-n // bs)
                    kc = torch.randn(nblk, bs, hkv, d, generator=g).to(dt)
                    vc = torch.randn(nblk, bs, hkv, d, generator=g).to(dt)
                    q = torch.randn(t, hq, d, generator=g).to(dt)
                    table = torch.arange(nblk, dtype=torch.int32)
                    seen = torch.arange(n)[None, :] <= torch.arange(past, n)[:, None]
                    mask = torch.zeros(seen.shape, dtype=dt).masked_fill(~seen, float("-inf"))[None, None]

                    def rows() -> object:
                        return cpu.rows_attention(q, kc, vc, table, past, scale, threads)  # noqa: B023

                    def segmented() -> object:
                        k = kc.view(-1, hkv, d)[:n].to(dt)  # noqa: B023
                        v = vc.view(-1, hkv, d)[:n].to(dt)  # noqa: B023
                        return M._segmented_attention(q, k, v, past, scale)  # noqa: B023

                    def one_call() -> object:
                        k = kc.view(-1, hkv, d)[:n].permute(1, 0, 2).repeat_interleave(hq // hkv, 0)[None]  # noqa: B023
                        v = vc.view(-1, hkv, d)[:n].permute(1, 0, 2).repeat_interleave(hq // hkv, 0)[None]  # noqa: B023
                        return flash(q.permute(1, 0, 2)[None], k, v, attn_mask=mask, scale=scale)[0]  # noqa: B023

                    fns = {"rows": rows, "segmented": segmented, "one_call": one_call}
                    times: dict[str, list[float]] = {k: [] for k in fns}
                    calls = 1 if t > 1 else 50
                    for r in range(a.rounds + 1):
                        for key, fn in fns.items():
                            t0 = time.perf_counter()
                            for _ in range(calls):
                                fn()
                            if r:                           # round 0 warms up
                                times[key].append((time.perf_counter() - t0) / calls * 1e3)
                    res = {k: round(statistics.median(v), 3) for k, v in times.items()}
                    out["timings_ms"].setdefault(name, {}).setdefault(f"threads{threads}", {}).setdefault(
                        f"rows{t}", {})[str(past)] = res
                    print(f"{name} threads {threads} rows {t:4d} past {past:5d}: "
                          + ", ".join(f"{k} {v:8.3f} ms" for k, v in res.items()), flush=True)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchjson import write
    write(out, a.out)


if __name__ == "__main__":
    main()
