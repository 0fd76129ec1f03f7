"""A prefill chunk through SmolLM2-135M's four layer linears (q|k|v 576->960, wo 576->576, gate|up 576->3072, w2
1536->576) in fp32, two row-invariant ways on this CPU:

  * ``oneDNN_packed``: torch.ops.mkldnn._linear_pointwise on the weight in oneDNN's blocked layout, what a CPU cell's
    prefill runs (model.RowLinear.pack; its rows' invariance is probed at start);
  * ``candidate``: prefill_linears.c beside this file (16-column panels, a 6 x 16 FMA tile, each row's sums in one
    fixed order, so rows are invariant by construction), built here with the machine's C compiler and the flags of
    the cell's own C kernels, checked against the product in fp64 and for row invariance before it is timed. Not
    served: this measures whether it would be worth serving.

Each round times both, one after the other, at each thread count, with a pause between them so neither finds the
other's threads still spinning; the figure is the median over --rounds of the mean over --calls layers, cycling
through --copies distinct layers' weights (30: every layer of the model, read from memory as a prefill reads them;
1: one layer's weights kept warm in the caches). Reported per layer (the four linears) in ms and as GFLOP/s.

    .venv/bin/python benchmarks/prefill_linears.py --out docs/bench/DATE/prefill_linears.json

Figures vary by CPU and by what else runs: the JSON records the CPU, torch and the load average.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]     # (out, in) of q|k|v, wo, gate|up, w2


def build(cpu) -> ctypes.CDLL:  # noqa: ANN001
    cc = cpu._compiler()
    if cc is None:
        raise SystemExit("no C compiler on PATH")
    lib = Path(tempfile.mkdtemp(prefix="modeld-prefill-linears-")) / "candidate.so"
    subprocess.run([cc, *cpu.FLAGS, str(Path(__file__).with_suffix(".c")), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.pl_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    dll.pl_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_int] * 3
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512, help="rows a call (a prefill chunk's tokens)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--copies", default="30,1", help="distinct layers' weights each timing cycles through")
    ap.add_argument("--calls", type=int, default=30, help="layers per timing")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="_out/prefill_linears.json")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "cellimage"))
    import torch

    from modeld_cell.kernels.paged_decode import cpu
    from modeld_cell.profile_gate import hardware

    dll = build(cpu)

    def pack(w: torch.Tensor) -> torch.Tensor:
        wp = torch.empty(w.numel())
        assert dll.pl_pack(w.data_ptr(), wp.data_ptr(), *w.shape) == 0
        return wp

    def candidate(x: torch.Tensor, wp: torch.Tensor, n: int, threads: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], n)
        assert dll.pl_linear(x.data_ptr(), wp.data_ptr(), y.data_ptr(), x.shape[0], n, x.shape[1], threads) == 0
        return y

    g = torch.Generator().manual_seed(0)
    check: dict = {}
    for n, k in SHAPES:                  # right, and rows invariant, before anything is timed
        w, x = torch.randn(n, k, generator=g), torch.randn(a.rows, k, generator=g)
        y = candidate(x, pack(w), n, 2)
        err = float((y.double() - x.double() @ w.double().T).abs().max() / (x.double() @ w.double().T).abs().max())
        assert err <= cpu.CHECK_TOL[torch.float32], (n, k, err)
        alone = torch.cat([candidate(x[i:i + 1], pack(w), n, 1) for i in (0, a.rows // 2, a.rows - 1)])
        assert torch.equal(alone, y[[0, a.rows // 2, a.rows - 1]]), (n, k)
        check[f"{n}x{k}"] = round(err, 9)
    print(f"candidate checked: relative error against fp64 {check}; rows bitwise equal alone", flush=True)

    out: dict = {"command": " ".join(["prefill_linears.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
                 "torch": torch.__version__, "loadavg_start": round(os.getloadavg()[0], 2),
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": a.rows,
                 "candidate_check": check, "per_layer_ms": {}, "gflop_s": {}, "rounds_ms": {}}
    flop = sum(2 * a.rows * n * k for n, k in SHAPES)
    xs = [torch.randn(a.rows, k, generator=g) for _, k in SHAPES]

    def timed(fn) -> float:  # noqa: ANN001
        t = time.perf_counter()
        for i in range(a.calls):
            fn(i)
        return (time.perf_counter() - t) / a.calls * 1e3

    with torch.inference_mode():
        for copies in (int(c) for c in a.copies.split(",")):
            layers = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(copies)]
            onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 2) for w in ws] for ws in layers]
            panels = [[pack(w) for w in ws] for ws in layers]
            del layers
            for th in (int(t) for t in a.threads.split(",")):
                calls = {
                    "oneDNN_packed": (th, lambda i: [torch.ops.mkldnn._linear_pointwise(  # noqa: B023
                        x, w, None, "none", [], "") for x, w in zip(xs, onednn[i % copies], strict=True)]),  # noqa: B023
                    "candidate": (1, lambda i: [candidate(x, w, n, th)  # noqa: B023
                                                for x, w, (n, _) in zip(xs, panels[i % copies], SHAPES,  # noqa: B023
                                                                        strict=True)]),
                }
                per: dict[str, list[float]] = {k: [] for k in calls}
                for torch_threads, fn in calls.values():            # warm-up
                    torch.set_num_threads(torch_threads)
                    timed(fn)
                for _ in range(a.rounds):
                    for name, (torch_threads, fn) in calls.items():
                        torch.set_num_threads(torch_threads)
                        time.sleep(0.3)
                        per[name].append(round(timed(fn), 3))
                key = f"{copies} layers' weights, {th} threads"
                med = {k: round(statistics.median(v), 3) for k, v in per.items()}
                out["per_layer_ms"][key], out["rounds_ms"][key] = med, per
                out["gflop_s"][key] = {k: round(flop / v / 1e6, 1) for k, v in med.items()}
                print(f"{key}: " + ", ".join(f"{k} {v:.3f} ms ({flop / v / 1e6:.1f} GFLOP/s)" for k, v in med.items())
                      + f"; candidate / oneDNN {med['candidate'] / med['oneDNN_packed']:.3f}", flush=True)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from benchjson import write
    write(out, a.out)


if __name__ == "__main__":
    main()
