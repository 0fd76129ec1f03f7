"""Whether a lossy serving profile is offered: its quality smoke, measured on this machine, cached by what decides it.

A profile that changes the numbers the model computes -- quantized weights multiplied by a quantized kernel
(``weights-int8``, ``weights-q4_1``: quantize.py), quantized KV (int8, fp8-e4m3, int4) or block-sparse prefill -- is
served only when its quality smoke (``quality.quality_smoke``: the same weights with fp32 KV and dense attention as
the reference; for quantized weights, the checkpoint's weights in fp32) passes ``quality.PROFILE_THRESHOLDS``. The verdict is a measurement, never a table in
the code: bf16 and quantized paths round differently on AVX-512-BF16, AMX and plain AVX2, and int4's teacher-forced
greedy agreement on SmolLM2-135M measured 0.8125 on one Xeon and 0.9167 on another (docs/kernels.md), either side of
its 0.9 bar.

The *measurement* is cached as JSON under ``<cache>/quality/<key>.json``, the key hashing everything the numbers
depend on: the hardware (CPU model and ISA flags, torch's CPU capability and the ISA-limiting variables, or the CUDA
device), torch's version, the weights (digest, adapter, compute dtype), the profile and its smoke settings, and
``SMOKE_VERSION``. The *verdict* is recomputed from the cached measurement and the thresholds every time, so changing
a threshold never needs a re-measurement, and changing the hardware or the weights always makes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import __version__, errors, quality

# Bump when quality_smoke's prompts, token counts or measured fields change: cached measurements then no longer apply.
SMOKE_VERSION = 2                      # 2: the reference's capital and passkey answers too
# The CPU flags that pick different kernels (and so different rounding) in torch's CPU paths and oneDNN.
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
_ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
            "DNNL_DEFAULT_FPMATH_MODE", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")
KV_SMOKE_MIB = 32                      # each smoke engine's KV pool (the smoke holds a few hundred tokens)


def gated_profiles(kv: str, attention_sparse: bool, weights_kernel: str = "dense") -> list[str]:
    """The profile names (keys of quality.PROFILE_THRESHOLDS) a cell's choice must pass before it is served: a
    quantized weights kernel (``weights-int8``, ``weights-q4_1``), a lossy KV format, block-sparse prefill."""
    out = [f"weights-{weights_kernel}"] if weights_kernel != "dense" else []
    out += [kv] if kv in quality.PROFILE_THRESHOLDS else []
    return out + (["block-sparse"] if attention_sparse else [])


def _field_of(profile: str) -> str:
    if profile == "block-sparse":
        return "profile.attention"
    return "profile.weights" if profile.startswith("weights-") else "profile.kv"


def hardware(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the rounding of this process's kernels depends on, as JSON."""
    device = torch.device(device)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"device": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
                "cuda": torch.version.cuda, "torch": torch.__version__}
    info: dict[str, str] = {}                  # the first CPU's "model name" and "flags" lines
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for ln in f:
                key, _, val = ln.partition(":")
                info.setdefault(key.strip(), val.strip())
                if "flags" in info:
                    break
    model, flags = info.get("model name") or platform.processor(), set(info.get("flags", "").split())
    return {"device": "cpu", "name": model, "machine": platform.machine(),
            "isa_flags": [f for f in _ISA_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_env": {k: os.environ[k] for k in _ISA_ENV if os.environ.get(k)}, "torch": torch.__version__}


def kernels_identity(device: torch.device | str = "cpu") -> dict[str, Any]:
    """The cache identity's ``kernels``: hardware() less what another field holds (torch's version) and, on a CPU,
    less the model name: two CPUs of one ISA pick the same kernels (their flags and torch's capability say so)."""
    hw = hardware(device)
    hw.pop("torch", None)
    if hw["device"] == "cpu":
        hw.pop("name", None)
    return hw


@dataclass
class Verdict:
    """A profile's quality smoke on this machine and what the thresholds make of it."""

    profile: str
    passed: bool
    failures: list[str]                 # quality.check's words; [] when it passes
    result: dict[str, Any]              # quality_smoke's measurement
    thresholds: dict[str, Any]
    hardware: dict[str, Any]
    key: str                            # the cache key of the measurement
    measured_at: str                    # RFC 3339, UTC
    measure_s: float                    # seconds the smoke took
    cached: bool                        # read from the cache (True) or measured by this process

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        r = self.result
        return (f"greedy agreement {r['greedy_agreement']}, mean next-token KL {r['kl_mean']}, max "
                f"{r['kl_max']}, capital {'ok' if r['capital']['ok'] else 'missed'}, passkey "
                f"{'ok' if r['passkey']['ok'] else 'missed'} over {r['positions']} positions")


def _smoke_args(profile: str) -> dict[str, Any]:
    """quality_smoke's arguments per profile: block-sparse is forced onto short prompts (min tokens 64, no density
    cut-off), which run dense otherwise; the passkey prompt is then long enough to span several sparse blocks."""
    if profile == "block-sparse":
        return {"prompts": quality.LONG_PROMPTS, "n_tokens": 24, "passkey_repeats": 14}
    return {}


def measurement_key(engine: Any, profile: str, hw: dict[str, Any]) -> str:
    ident = engine.identity
    payload = {"hardware": hw, "profile": profile, "smoke": _smoke_args(profile), "smoke_version": SMOKE_VERSION,
               "modeld": __version__, "weights": {k: ident.get(k) for k in ("model_digest", "adapter",
                                                                            "weights_dtype", "weights_kernel")},
               "sparse": (engine.settings.sparse_keep_ratio, engine.settings.sparse_max_keep_tokens)
               if profile == "block-sparse" else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


async def _measure(engine: Any, profile: str) -> dict[str, Any]:
    """quality_smoke of ``profile`` on two siblings of ``engine`` (its weights, their own small KV pools), so the
    served engine's cache and counters are untouched."""
    from .engine import EngineSettings

    st = engine.settings
    if profile.startswith("weights-"):
        # the quantized weights (fp32 KV, dense) against the same checkpoint's weights in fp32, dense
        ref = _fp32_reference(engine)
        cand = engine.sibling(kv="fp32", attention="dense", kv_mib=KV_SMOKE_MIB)
        try:
            return await quality.quality_smoke(cand, ref, **_smoke_args(profile))
        finally:
            cand.shutdown()
            ref.shutdown()
    ref = engine.sibling(kv="fp32", attention="dense", kv_mib=KV_SMOKE_MIB)
    if profile == "block-sparse":
        forced = EngineSettings(threads=st.threads, sparse_min_tokens=64, sparse_max_density=1.0,
                                sparse_keep_ratio=st.sparse_keep_ratio, sparse_max_keep_tokens=st.sparse_max_keep_tokens)
        cand = engine.sibling(kv="fp32", attention="block-sparse", kv_mib=KV_SMOKE_MIB, settings=forced)
    else:
        cand = engine.sibling(kv=profile, attention="dense", kv_mib=KV_SMOKE_MIB)
    try:
        r = await quality.quality_smoke(cand, ref, **_smoke_args(profile))
        if profile == "block-sparse":   # the smoke must have exercised the sparse path, not the dense fallback
            r["sparse_chunks"] = cand.sparse_stats["chunks_sparse"]
        return r
    finally:
        cand.shutdown()
        ref.shutdown()


def _fp32_reference(engine: Any) -> Any:
    """A sibling of ``engine`` over the cell's checkpoint in fp32 with dense matmuls (``engine.fp32_weights``, the
    loader's builder, alive only while the loader gates the cell), fp32 KV, dense attention."""
    build = getattr(engine, "fp32_weights", None)
    if build is None:
        raise errors.Fatal("the quality smoke of quantized weights needs the checkpoint's fp32 weights: gate the "
                           "engine while the loader holds them (loader.load_engine)")
    return engine.sibling(kv="fp32", attention="dense", kv_mib=KV_SMOKE_MIB, model=build(), weights="fp32",
                          identity={"weights_dtype": "fp32", "weights_kernel": "dense"})


def _run(coro: Any) -> Any:
    """Run a coroutine from sync code, also when the caller's thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def read_measurement(path: str | None, key: str, field: str, kind: type) -> dict[str, Any] | None:
    """A cached measurement record (JSON at ``path``) whose ``key`` is ``key`` and whose ``field`` is a ``kind``;
    None when there is none, or it is unreadable or foreign (then it is measured again)."""
    if not path or not os.path.isfile(path):
        return None
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            rec = json.load(f)
        if isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get(field), kind):
            return rec
    return None


def write_measurement(path: str | None, rec: dict[str, Any]) -> None:
    """Write a measurement record to ``path`` (None: not cached) whole or not at all (a temporary file, renamed)."""
    if not path:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def verdict(engine: Any, profile: str, cache_dir: str | None,
            thresholds: dict[str, Any] | None = None, hw: dict[str, Any] | None = None) -> Verdict:
    """The verdict on ``profile`` for ``engine``'s weights on this hardware: the cached measurement when one exists
    for the same key, else a new one (written to the cache). ``thresholds`` default to quality.PROFILE_THRESHOLDS."""
    hw = hw if hw is not None else hardware(engine.kv.device)
    key = measurement_key(engine, profile, hw)
    path = os.path.join(cache_dir, "quality", f"{key}.json") if cache_dir else None
    rec = read_measurement(path, key, "result", dict)
    cached = rec is not None
    if rec is None:
        t0 = time.perf_counter()
        result = _run(_measure(engine, profile))
        rec = {"key": key, "profile": profile, "hardware": hw, "result": result,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "measure_s": round(time.perf_counter() - t0, 2)}
        write_measurement(path, rec)
    t = dict(thresholds if thresholds is not None else quality.PROFILE_THRESHOLDS[profile])
    failures = quality.check(profile, rec["result"], t)
    if profile == "block-sparse" and not rec["result"].get("sparse_chunks"):
        failures.append("the smoke ran no chunk on the sparse path")
    return Verdict(profile=profile, passed=not failures, failures=failures, result=rec["result"], thresholds=t,
                   hardware=rec["hardware"], key=key, measured_at=rec["measured_at"], measure_s=rec["measure_s"],
                   cached=cached)


def require(engine: Any, cache_dir: str | None, thresholds: dict[str, dict[str, Any]] | None = None,
            hw: dict[str, Any] | None = None) -> list[Verdict]:
    """Verdicts on every gated profile of ``engine``'s cell; raises errors.Unsupported naming the spec field and
    the measured numbers when one fails. ``thresholds`` maps a profile to the thresholds to use instead of
    quality.PROFILE_THRESHOLDS (tests)."""
    out = []
    for p in gated_profiles(engine.config.kv, engine.sparse, engine.config.weights_kernel):
        v = verdict(engine, p, cache_dir, (thresholds or {}).get(p), hw)
        if not v.passed:
            fld = _field_of(p)
            against = ("the same checkpoint's weights in fp32" if fld == "profile.weights"
                       else "the same weights with fp32 KV and dense attention")
            raise errors.Unsupported(
                f"{fld} {p.removeprefix('weights-')!r} is not offered on this machine: its quality smoke, measured "
                f"here against {against}, fails ({'; '.join(v.failures)}); measured: {v.summary()}",
                field=fld, value=p.removeprefix("weights-"), verdict=v.to_dict())
        out.append(v)
    return out
