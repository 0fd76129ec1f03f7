"""The worker's engine end to end on the device: the triton backend against the torch path on the same device.

A synthetic model with SmolLM2-135M's real shapes (random weights from a fixed seed, RoPE tables long enough for
the contexts) stands in for the weights: the real GGUF is 93 MB and a device call carries at most 64 MiB, and speed
does not depend on the weights' values. Greedy agreement between the two backends is still a real check (the same
weights on both). Per context: first output (ensure_prefix of a fresh prompt, then the first decoded token) and
decode ms/token, for the triton and the torch engine; then greedy agreement over 16 tokens. A warm-up prompt per
engine comes first and is reported apart (``warmup``: its first output includes Triton's JIT compiles), so the
measured contexts time the kernels, not their compilation.

Two diagnostics follow, on the shortest context's prompt:
- ``first_token``: the logits of the prompt's last position from each backend's runner (chunked as the engine
  chunks) against an fp32 copy of the model on the torch runner: max |diff|, whether the argmax agrees, and the fp32
  top-1/top-2 margin. With random weights the logits are nearly flat, so a margin below the bf16 error means a
  greedy disagreement is rounding, not a kernel fault.
- ``decode_profile``: torch.profiler over a few decode steps of each engine: wall ms/step, GPU kernel ms/step and
  kernels launched per step (a step whose wall time is far above its kernel time is bound by the host), and the
  host ops that took the most time.

    PYTHONPATH=cellimage:api python benchmarks/engine_gpu.py --out _out/engine.json          # CUDA: 8k and 32k
    TRITON_INTERPRET=1 ... engine_gpu.py --dry-run --out ...                                 # CPU: tiny, 2 layers

Needs pydantic (the engine's config is the Cell spec's); hack/gpu-bench.sh installs carried wheels first.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cellimage"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "api"))

from modeld_cell.config import CellConfig, EngineSettings  # noqa: E402
from modeld_cell.contract import SamplingParams  # noqa: E402
from modeld_cell.engine import Engine  # noqa: E402
from modeld_cell.kv_cache import PagedKVCache, kv_format  # noqa: E402
from modeld_cell.model import ModelArgs, Transformer  # noqa: E402
from modeld_cell.prefix_index import common_prefix  # noqa: E402


class SyntheticTokenizer:
    """Token ids in, text out for a model without a vocabulary file: each id decodes to one printable character."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eos_token_ids, self.hash, self.template_hash = vocab_size, [], "synthetic", "synthetic"

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)


def synthetic_model(layers: int, max_seq: int, dtype: torch.dtype, device: str) -> Transformer:
    args = dataclasses.replace(ModelArgs.from_name("smollm2-135m"), n_layers=layers, max_seq_len=max_seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args)
    for p in model.parameters():                      # small weights keep activations in range over 30 layers
        torch.nn.init.normal_(p, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
    model.init_rope()
    return model.to(dtype).eval()


def engine(model: Transformer, backend: str, tier: int, kv_mib: int, device: str) -> Engine:
    spec = {"runtime": {"backend": backend}, "topology": {"gpus": 1 if backend == "triton" else 0,
                                                          "interconnect": "none"},
            "model": {"family": "smollm2", "ref": "synthetic"}, "profile": {"weights": "fp32", "kv": "fp32"},
            "contextTier": max(512, tier), "kvMemoryMiB": max(16, kv_mib)}
    cfg = CellConfig.from_spec(spec)
    cfg.context_tier = tier
    cfg.device, cfg.weights = device, str(model.tok_embeddings.weight.dtype).removeprefix("torch.").replace(
        "float32", "fp32").replace("bfloat16", "bf16")
    cfg.kv = "bf16" if cfg.weights == "bf16" else "fp32"
    a = model.args
    kv = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(cfg.kv), kv_mib << 20, device=device)
    identity = {"model_name": "synthetic", "model_family": "smollm2", "model_format": "synthetic",
                "model_digest": "synthetic-seed-0", "source_sha256": None, "weights_dtype": cfg.weights,
                "backend": f"{backend}-{torch.device(device).type}", "backend_version": torch.__version__,
                "kv_dtype": cfg.kv, "tokenizer_hash": "synthetic", "template_hash": "synthetic",
                "params": sum(p.numel() for p in model.parameters()), "adapter": None, "manifest_hash": None}
    eng = Engine(model, SyntheticTokenizer(a.vocab_size), kv, cfg, identity,
                 EngineSettings(threads=torch.get_num_threads(), prefill_chunk=max(512, min(tier, 8192))))
    eng.runner.choose_decode_kernel("auto")
    return eng


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def measure(eng: Engine, prompt: list[int], n: int, device: str) -> dict:
    sid = f"s{len(prompt)}"
    sync(device)
    t0 = time.perf_counter()
    await eng.ensure_prefix(sid, prompt)
    toks, stamps = [], []
    async for ev in eng.decode(sid, SamplingParams(), n):
        if not ev.done:
            toks.append(ev.token_id)
            stamps.append(time.perf_counter())
    first = stamps[0] - t0
    per = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    eng.close_session(sid)
    return {"first_output_ms": round(first * 1e3, 2), "decode_ms_per_token_p50": round(per[len(per) // 2] * 1e3, 3)
            if per else None, "tokens": toks}


def first_logits(eng: Engine, prompt: list[int], chunk: int) -> torch.Tensor:
    """The last position's logits from the engine's runner, the prompt prefilled in chunks into blocks taken from
    its pool and given back after (as any session's are)."""
    r = eng.runner
    blocks = r.kv.allocate(r.kv.blocks_for(len(prompt)))
    try:
        for s in range(0, len(prompt), chunk):
            logits, _, _ = r.prefill(prompt[s:s + chunk], s, blocks)
        return logits.float()
    finally:
        r.kv.free(blocks[::-1])


def first_token_check(engines: dict[str, Engine], ref: Engine, prompt: list[int], chunk: int) -> dict:
    want = first_logits(ref, prompt, chunk)
    top = torch.topk(want, 2).values
    out: dict = {"context": len(prompt), "fp32_top1_minus_top2": round(float(top[0] - top[1]), 5)}
    for b, e in engines.items():
        got = first_logits(e, prompt, chunk)
        out[b] = {"max_abs_vs_fp32": round(float((got - want).abs().max()), 5),
                  "argmax_equals_fp32": int(got.argmax()) == int(want.argmax())}
    return out


async def decode_profile(eng: Engine, prompt: list[int], n: int, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    sid = "profiled"
    await eng.ensure_prefix(sid, prompt)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    stamps = []
    with profile(activities=acts) as prof:
        async for ev in eng.decode(sid, SamplingParams(), n + 1):
            if not ev.done:
                stamps.append(time.perf_counter())
        sync(device)
    eng.close_session(sid)
    steps = max(1, len(stamps) - 1)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10).splitlines()
    return {"context": len(prompt), "steps": steps,
            "wall_ms_per_step": round((stamps[-1] - stamps[0]) * 1e3 / steps, 3) if len(stamps) > 1 else None,
            "gpu_kernel_ms_per_step": round(sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / (n + 1), 3),
            "kernels_per_step": round(len(kernels) / (n + 1), 1), "top_host_ops": table}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU under the Triton interpreter, tiny shapes")
    ap.add_argument("--contexts", default=None, help="comma list (default: 8192,32768 on CUDA; 64,96 dry)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = "cuda" if cuda else "cpu"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("without CUDA this runs only as --dry-run with TRITON_INTERPRET=1")
    contexts = [int(x) for x in (a.contexts or ("8192,32768" if cuda else "64,96")).split(",")]
    layers, dtype = (30, torch.bfloat16) if cuda else (2, torch.float32)
    tier = max(contexts) + a.decode_tokens + 16
    kv_mib = 4096 if cuda else 16
    model = synthetic_model(layers, tier, dtype, device)
    res: dict = {"command": " ".join([pathlib.Path(sys.executable).name] + sys.argv), "device":
                 torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)", "torch": torch.__version__,
                 "model": f"synthetic, SmolLM2-135M shapes, {layers} layers, {str(dtype)[6:]}", "contexts": {}}
    engines = {b: engine(model, b, tier, kv_mib, device) for b in ("triton", "torch")}
    res["startup_check"] = engines["triton"].runner.startup_check()
    g = torch.Generator().manual_seed(1)
    warm = torch.randint(0, model.args.vocab_size, (min(256, min(contexts)),), generator=g).tolist()
    res["warmup"] = {b: {k: v for k, v in (await measure(e, warm, 4, device)).items() if k != "tokens"}
                     for b, e in engines.items()}
    print("warmup", res["warmup"], flush=True)
    prompts: dict[int, list[int]] = {}
    for n in contexts:
        prompt = prompts[n] = torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()
        row = {b: await measure(e, prompt, a.decode_tokens, device) for b, e in engines.items()}
        same = common_prefix(row["triton"]["tokens"], row["torch"]["tokens"])
        res["contexts"][str(n)] = {**{b: {k: v for k, v in r.items() if k != "tokens"} for b, r in row.items()},
                                   "greedy_tokens_identical": same, "of": a.decode_tokens}
        print(n, res["contexts"][str(n)], flush=True)
    chunk = max(512, min(tier, 8192))
    short = prompts[min(contexts)]                      # the measured prompt: its greedy agreement is in contexts
    prof = {b: await decode_profile(e, short, 8, device) for b, e in engines.items()}
    res["decode_profile"] = prof
    print("decode_profile", {b: {k: v for k, v in p.items() if k != "top_host_ops"} for b, p in prof.items()},
          flush=True)
    res["kernels"] = engines["triton"].runner.kernels()
    ref = engine(copy.deepcopy(model).float(), "torch", tier, kv_mib * 2, device)
    res["first_token"] = first_token_check(engines, ref, short, chunk)
    print("first_token", res["first_token"], flush=True)
    ref.shutdown()
    for e in engines.values():
        e.shutdown()
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    asyncio.run(main())
