"""One decode row through SmolLM2-135M's four layer linears (q|k|v 576->960, wo 576->576, gate|up 576->3072, w2
1536->576), the way each of the CPU cell's steps multiplies it, on this CPU:

  * ``oneDNN_packed``: torch.ops.mkldnn._linear_pointwise on the weight in oneDNN's blocked layout
    (model.RowLinear.pack), the recomputing torch step's one-row multiply;
  * ``plain``: F.linear on the plain [out, in] weight (oneDNN reorders it inside the call);
  * ``cpu_kernel``: kernels/paged_decode/cpu.c's row linear (the whole-layer decode step's: plain weights streamed
    with prefetch, fp32 sums), at each thread count of --threads (its helper threads take a share of the rows).
  * dtype ``q4_1``: the same rows as Q4_1 blocks (quantize.q4_1_blocks: 4-bit codes, fp32 d and m a 32-weight
    group) through cpu.c's Q4_1 row linear (``cpu_kernel``), the layer step's linears for a Q4_1 file.

Each timing cycles through --copies distinct layers' weights, as a decode step reads each layer's weights from memory
once: with one copy they stay in the CPU's cache and the figure is a warm one. Reported per layer (the four linears)
in microseconds, and as the weights' GB/s.

    .venv/bin/python benchmarks/row_linear.py --out docs/bench/DATE/row_linear.json

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
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]     # (out, in) of q|k|v, wo, gate|up, w2


def timed(a: argparse.Namespace, layer_fn) -> float:  # noqa: ANN001
    """Median us a layer over --rounds timings of --calls layers, cycling through --copies (after one pass)."""
    for i in range(a.copies):
        layer_fn(i)
    per = []
    for _ in range(a.rounds):
        t = time.perf_counter()
        for i in range(a.calls):
            layer_fn(i % a.copies)
        per.append((time.perf_counter() - t) / a.calls * 1e6)
    return round(statistics.median(per), 1)


def q4_rows(a: argparse.Namespace, cpu, g, threads: list[int], us_of) -> dict:  # noqa: ANN001
    """The ``q4_1`` figures: --copies layers of Q4_1 blocks through cpu.c's Q4_1 row linear, per thread count."""
    import torch

    from modeld_cell.quantize import q4_1_blocks
    layers = [[q4_1_blocks(torch.randn(n, k, generator=g) * 0.02) for n, k in SHAPES] for _ in range(a.copies)]
    xs = [torch.randn(k, generator=g) for _, k in SHAPES]
    res: dict = {}
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    for th in threads:
        res[str(th)] = {"cpu_kernel": us_of(lambda i: [cpu.gemv_q4(*b, x, threads=th)  # noqa: B023
                                                         for x, b in zip(xs, layers[i], strict=True)])}
    torch.set_num_threads(was)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,fp32,q4_1")
    ap.add_argument("--threads", default="1,2", help="thread counts (torch's intra-op count, the kernel's helpers)")
    ap.add_argument("--copies", type=int, default=30, help="distinct layers' weights each timing cycles through")
    ap.add_argument("--calls", type=int, default=60, help="layers per timing (median of --rounds)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="_out/row_linear.json")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "cellimage"))
    import torch

    from modeld_cell.kernels.paged_decode import cpu
    from modeld_cell.model import can_pack
    from modeld_cell.profile_gate import hardware

    build = cpu.load(None)
    print(f"cpu kernel: {build['reason']}", flush=True)
    g = torch.Generator().manual_seed(0)
    threads = [int(x) for x in a.threads.split(",")]
    out: dict = {"command": " ".join(["row_linear.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
                 "torch": torch.__version__, "loadavg_start": round(os.getloadavg()[0], 2),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copies": a.copies,
                 "cpu_kernel_build": build, "per_layer_us": {}, "weights_gb_s": {}}
    was = torch.get_num_threads()
    for name in a.dtypes.split(","):
        if name == "q4_1":
            res = q4_rows(a, cpu, g, threads, us_of=lambda fn: timed(a, fn))
            out["per_layer_us"][name] = res
            nbytes = sum(n * k // 2 + 8 * n * k // 32 for n, k in SHAPES)
            out["weights_gb_s"][name] = {th: {k: round(nbytes / v / 1e3, 1) for k, v in row.items()}
                                         for th, row in res.items()}
            for th, row in res.items():
                print(f"q4_1 {th} thread(s): " + ", ".join(f"{k} {v:7.1f} us ({nbytes / v / 1e3:.1f} GB/s)"
                                                          for k, v in row.items()), flush=True)
            continue
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        layers = [[(torch.randn(n, k, generator=g) * 0.02).to(dt) for n, k in SHAPES] for _ in range(a.copies)]
        xs = [torch.randn(1, k, generator=g).to(dt) for _, k in SHAPES]
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 2) for w in ws] for ws in layers] \
            if can_pack(dt) else None
        nbytes = sum(n * k for n, k in SHAPES) * (2 if dt == torch.bfloat16 else 4)

        def us(layer_fn) -> float:  # noqa: ANN001
            return timed(a, layer_fn)

        res: dict = {}
        with torch.inference_mode():
            for th in threads:
                torch.set_num_threads(th)
                row: dict = {"plain": us(lambda i: [torch.nn.functional.linear(x, w)    # noqa: B023
                                                    for x, w in zip(xs, layers[i], strict=True)])}  # noqa: B023
                if packed is not None:
                    row["oneDNN_packed"] = us(lambda i: [  # noqa: B023
                        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                        for x, w in zip(xs, packed[i], strict=True)])  # noqa: B023
                if build["loaded"]:
                    torch.set_num_threads(1)              # the kernel's own threads, as the layer step runs them
                    row["cpu_kernel"] = us(lambda i: [cpu.gemv(w, x.view(-1), threads=th)  # noqa: B023
                                                      for x, w in zip(xs, layers[i], strict=True)])  # noqa: B023
                res[str(th)] = row
                print(f"{name} {th} thread(s): " + ", ".join(f"{k} {v:7.1f} us ({nbytes / v / 1e3:.1f} GB/s)"
                                                           for k, v in row.items()), flush=True)
        torch.set_num_threads(was)
        out["per_layer_us"][name] = res
        out["weights_gb_s"][name] = {th: {k: round(nbytes / v / 1e3, 1) for k, v in row.items()}
                                     for th, row in res.items()}
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchjson import write
    write(out, a.out)


if __name__ == "__main__":
    main()
