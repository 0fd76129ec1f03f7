"""What ``auto``'s measurement costs a start and what it finds: ``autotune.choose`` for a ``profile.weights``
on the real SmolLM2-135M shapes, each time with an empty cache (so it measures), as a worker's start calls it (the
thread count, packing and the head the loader would pass).

Per run: the seconds ``choose`` took, the path it chose and every candidate's figures (decode ms, prefill ms per token,
the agent turn, ``pruned`` where a candidate's decode alone outlasted the best turn so far and its prefill was not
timed). Figures vary by CPU and by what else runs: the JSON records the CPU, torch, threads and load average.

    .venv/bin/python benchmarks/autotune_cpu.py --out docs/bench/DATE/autotune_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="q4_1", help="profile.weights (default: the laptop cell's q4_1)")
    ap.add_argument("--head", default="int8", choices=["int8", "dense", "own"],
                    help="a quantized candidate's head: int8 or dense (what the loader passes for SmolLM2's Q4_1 "
                         "GGUF with MODELD_INT8_HEAD 1 / 0), own: the format's kernel")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default="_out/autotune_cpu.json")
    a = ap.parse_args()
    if a.runs < 1:
        ap.error("--runs must be at least 1")
    sys.path.insert(0, str(REPO / "cellimage"))
    import torch

    from modeld_cell import autotune
    from modeld_cell.config import EngineSettings
    from modeld_cell.model import transformer_configs
    from modeld_cell.profile_gate import hardware

    torch.set_num_threads(EngineSettings().threads)
    args = transformer_configs["smollm2-135m"]
    runs = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as cache:
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            c = autotune.choose(args, a.weights, cache, head=None if a.head == "own" else a.head, pack=True)
            took = time.perf_counter() - t0
        runs.append({"choose_s": round(took, 2), "chosen": c.name, "reason": c.reason, "candidates": c.candidates,
                     "loadavg_before": round(load0, 2)})
        print(f"run {i + 1}: {took:.1f} s, chose {c.name}: {c.reason}")
    res = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "hardware": hardware("cpu"),
           "host": platform.node(), "threads": torch.get_num_threads(), "autotune_version": autotune.AUTOTUNE_VERSION,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
