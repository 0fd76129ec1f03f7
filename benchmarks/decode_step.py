"""What each of the decode step's CPU changes buys (#18), measured in one process so that the machine's drift falls on
every variant alike: the variants take turns, round after round, on the same loaded engine.

Variants, each adding one change to the one before:
  before      _segmented_attention's general path for the decode row, plain weights, the process's thread count
  row-path    + model._segmented_row (the same flash calls and merge in fewer ops)
  packed      + oneDNN-packed dense layer weights (model.pack_linears; dense paths only)
  one-thread  + one intra-op thread for a one-session decode step (runner.decode_threads = 1)
  scripted    + the step's layers as one TorchScript graph (decode_step.py; runner.decode_step)
The q/k RoPE fusion and the cached causal mask are in every variant (they cannot be switched off); the logits of
every variant's decoded tokens (the K/V each layer wrote for them) are compared bit for bit with the first
variant's (``bitwise_equal``) and with the variant's before it (``bitwise_equal_to_previous_variant``: which change
moved the bits, if one did).

Each round, per variant: a session over the first --context tokens of the corpus (the prefix cache makes its prefill
a reuse after the first), --steps greedy tokens decoded, ms/token p50 of those after the first; the variant's figure
is the median over rounds. The real SmolLM2-135M Q4_1 GGUF, the weights path forced with --weights-path.

    .venv/bin/python benchmarks/decode_step.py --out docs/bench/DATE/decode_step.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("before", "row-path", "packed", "one-thread", "scripted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights-path", default="dense-bf16", help="MODELD_WEIGHTS_PATH (profile.weights is q4_1)")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="_out/decode_step.json")
    a = ap.parse_args()
    os.environ["MODELD_WEIGHTS_PATH"] = a.weights_path
    os.environ["MODELD_DECODE_THREADS"] = "auto"
    os.environ["MODELD_DECODE_STEP"] = "script"      # compiled and checked at start; the variants switch it
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from cell_cpu import corpus_text
    from weights_cpu import rss_mib, spec

    from modeld_cell import model as M
    from modeld_cell.contract import SamplingParams
    from modeld_cell.engine import Engine
    from modeld_cell.profile_gate import hardware

    contexts = [int(x) for x in a.contexts.split(",")]
    eng = Engine.from_cell(spec("q4_1", max(512, max(contexts) + a.steps + 64)))
    ids = eng.tokenizer.encode(corpus_text())
    runner, model = eng.runner, eng.model
    row_fn = M._segmented_row
    process_threads = torch.get_num_threads()
    packable = eng.config.weights_kernel == "dense"
    scripted = runner.decode_step

    def general_row(q, k, v, q0, scale, seg):  # noqa: ANN001, ANN202
        return M._segmented_attention(q, k, v, q0, scale, seg, row_path=False)

    def setup(variant: str) -> None:                     # on the torch thread
        i = VARIANTS.index(variant)
        M._segmented_row = row_fn if i >= 1 else general_row
        if i >= 2 and packable:
            M.pack_linears(model)
        else:
            M.unpack_linears(model)
        runner.decode_threads = 1 if i >= 3 and process_threads > 1 else None
        runner.decode_step = scripted if i >= 4 else None

    variants = [v for v in VARIANTS if packable or v != "packed"]
    ms: dict[int, dict[str, list[float]]] = {n: {v: [] for v in variants} for n in contexts}
    logits: dict[int, list] = {n: [] for n in contexts}
    equal = {n: True for n in contexts}
    same: dict[int, dict[str, bool]] = {n: {} for n in contexts}     # each variant's K/V against the variant before

    async def run() -> None:
        for r in range(a.rounds):
            for n in contexts:
                for v in variants:
                    eng.on_torch_thread(setup, v)
                    sid = f"{v}-{n}-{r}"
                    await eng.ensure_prefix(sid, ids[:n])
                    per: list[float] = []
                    async for ev in eng.decode(sid, SamplingParams(), a.steps, stop_token_ids=[]):
                        if ev.done:
                            per = ev.trace.decode_ms_per_token
                    if r == 0:                           # the K/V every layer wrote for the decoded tokens
                        s = eng._session(sid)
                        kv = eng.kv.read_tokens(s.blocks, len(s.tokens) - 1)
                        prev = logits[n][-1] if logits[n] else kv
                        logits[n].append(kv)
                        same[n][v] = all(torch.equal(x, y) for x, y in zip(prev, kv, strict=True))
                        equal[n] = equal[n] and all(torch.equal(x, y) for x, y in zip(logits[n][0], kv, strict=True))
                    ms[n][v].append(statistics.median(per[1:]))
                    eng.close_session(sid)
                    print(f"round {r} context {n} {v:10s} {ms[n][v][-1]:7.1f} ms/token", flush=True)

    asyncio.run(run())
    res = {"command": " ".join(["decode_step.py", *sys.argv[1:]]), "hardware": hardware("cpu"),
           "host": platform.node(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "loadavg_end": round(os.getloadavg()[0], 2), "weights_kernel": eng.identity["weights_kernel"],
           "process_threads": process_threads, "startup_decode_threads": runner.decode_threads_report,
           "startup_decode_step": runner.decode_step_report,
           "rss_mib": rss_mib(), "steps": a.steps, "rounds": a.rounds,
           "contexts": {str(n): {"ms_per_token_p50": {v: round(statistics.median(x), 2) for v, x in ms[n].items()},
                                 "rounds": {v: [round(y, 2) for y in x] for v, x in ms[n].items()},
                                 "bitwise_equal": equal[n], "bitwise_equal_to_previous_variant": same[n]}
                        for n in contexts}}
    eng.shutdown()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for n in contexts:
        print(n, res["contexts"][str(n)]["ms_per_token_p50"], "bitwise_equal", equal[n], "each to the one before",
              same[n])
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
