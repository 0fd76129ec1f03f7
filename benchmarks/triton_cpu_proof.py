"""The triton backend against the torch path on the FULL SmolLM2-135M-Instruct (all 30 layers), on this machine.

Under the Triton interpreter on a CPU (TRITON_INTERPRET=1, set here when there is no GPU) this is slow, which is why
the CI proof (tests/cell/test_triton_backend.py) runs a stated prefix of the layers; this script runs the whole
model once and writes what it measured: greedy agreement and the logits' max abs difference per scenario, the
kernels that ran, and the wall time of each engine.

    .venv/bin/python benchmarks/triton_cpu_proof.py --out docs/bench/<date>/triton_cpu_proof.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

from modeld_cell.engine import Engine, EngineSettings, SamplingParams  # noqa: E402
from modeld_cell.models.fetch import SMOLLM2_REF  # noqa: E402
from modeld_cell.prefix_index import common_prefix  # noqa: E402

SPEC = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
        "model": {"family": "smollm2", "ref": SMOLLM2_REF, "format": "gguf"},
        "profile": {"weights": "fp32", "kv": "fp32", "attention": "dense", "prefixReuse": True},
        "contextTier": 2048, "kvMemoryMiB": 64}
TEXT = ("The harbour master wrote every ship's name in a blue book, and the tide tables beside them. "
        "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n")


async def run(eng: Engine, kv: str, prompt: list[int], n: int) -> dict:
    e = eng.sibling(kv=kv, kv_mib=64) if kv != "fp32" else eng
    t0 = time.perf_counter()
    await e.ensure_prefix("p", prompt)
    logits = e.next_token_logits("p")
    toks = []
    async for ev in e.decode("p", SamplingParams(), n):
        if not ev.done:
            toks.append(ev.token_id)
    out = {"tokens": toks, "logits": logits, "wall_s": round(time.perf_counter() - t0, 2),
           "kernels": e.runner.kernels()}
    e.close_session("p")
    if e is not eng:
        e.shutdown()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--kv", default="fp32,int8,fp8-e4m3")
    ap.add_argument("--out", default="_out/triton_cpu_proof.json")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    st = EngineSettings(threads=torch.get_num_threads())
    ref = Engine.from_cell(SPEC, settings=st)
    tri = Engine.from_cell({**SPEC, "runtime": {"backend": "triton"}, "topology": {"gpus": 1, "interconnect": "none"}},
                           settings=EngineSettings(threads=st.threads), device=dev)
    prompt = ref.tokenizer.encode(TEXT * 20)[: a.prompt_tokens]
    res = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "device": dev,
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "interpreter": os.environ.get("TRITON_INTERPRET"),
           "threads": st.threads, "layers": ref.model.args.n_layers, "prompt_tokens": len(prompt),
           "startup_check": tri.startup, "scenarios": {}}
    for kv in a.kv.split(","):
        r, t = await run(ref, kv, prompt, a.decode_tokens), await run(tri, kv, prompt, a.decode_tokens)
        agree = common_prefix(r["tokens"], t["tokens"])
        res["scenarios"][kv] = {
            "greedy_tokens_identical": agree, "of": len(r["tokens"]),
            "logits_max_abs_diff": float((r["logits"] - t["logits"].cpu()).abs().max()),
            "torch_wall_s": r["wall_s"], "triton_wall_s": t["wall_s"], "triton_kernels": t["kernels"]}
        print(kv, res["scenarios"][kv], flush=True)
    ref.shutdown()
    tri.shutdown()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("wrote", a.out)


if __name__ == "__main__":
    asyncio.run(main())
