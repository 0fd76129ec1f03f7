"""The engine's settings (environment, read once) and the parts of a Cell spec it uses.

``CellConfig.from_spec`` reads a spec the API package (modeld_api) has validated, or a bare dict in tests and
benchmarks; EngineSettings' variables are documented in docs/worker.md (a unit test compares the two).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from modeld_api.served import unserved_values

from . import errors
from .kernels.sparse_prefill import reference as sparse_ref
from .kv_cache import DEFAULT_KV_MEMORY_MIB, kv_format

SUPPORTED_ATTENTION = ("dense",)
SPARSE_ATTENTION = ("block-sparse",)
SPARSE_BLOCK = 64                         # block-sparse prefill: tokens per query/key block (the kernels' default)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class EngineSettings:
    """Process settings, read once from the environment (documented in docs/engine-interface.md)."""

    threads: int = field(default_factory=_cpu_count)   # MODELD_THREADS: torch intra-op threads (default: cores)
    prefill_chunk: int = 512                            # MODELD_PREFILL_CHUNK: tokens per prefill forward
    max_decode_batch: int = 64                          # MODELD_MAX_DECODE_BATCH: sessions per decode forward
    decode_attention: str = "auto"                      # MODELD_DECODE_ATTENTION: auto | dispatch | torch
    # block-sparse cells only (profile.attention: block-sparse); defaults are kernels/sparse_prefill's choose_path
    sparse_min_tokens: int = sparse_ref.DENSE_BELOW_TOKENS    # MODELD_SPARSE_MIN_TOKENS: shorter prefills run dense
    sparse_max_density: float = sparse_ref.DENSE_ABOVE_DENSITY  # MODELD_SPARSE_MAX_DENSITY: denser masks run dense
    sparse_keep_ratio: float = 0.1                      # MODELD_SPARSE_KEEP_RATIO: vertical-slash estimate's keep ratio
    sparse_max_keep_tokens: int = sparse_ref.MAX_KEEP_TOKENS  # MODELD_SPARSE_MAX_KEEP_TOKENS: its cap, in tokens

    @classmethod
    def from_env(cls) -> EngineSettings:
        s = cls()
        for attr, env in (("threads", "MODELD_THREADS"), ("prefill_chunk", "MODELD_PREFILL_CHUNK"),
                          ("max_decode_batch", "MODELD_MAX_DECODE_BATCH"),
                          ("sparse_min_tokens", "MODELD_SPARSE_MIN_TOKENS"),
                          ("sparse_max_keep_tokens", "MODELD_SPARSE_MAX_KEEP_TOKENS")):
            if os.environ.get(env):
                v = int(os.environ[env])
                if v < 1:
                    raise ValueError(f"{env} must be >= 1, got {v}")
                setattr(s, attr, v)
        if s.sparse_max_keep_tokens < SPARSE_BLOCK:
            raise ValueError(f"MODELD_SPARSE_MAX_KEEP_TOKENS must be >= the sparse block size {SPARSE_BLOCK}, got "
                             f"{s.sparse_max_keep_tokens}")
        for attr, env in (("sparse_max_density", "MODELD_SPARSE_MAX_DENSITY"),
                          ("sparse_keep_ratio", "MODELD_SPARSE_KEEP_RATIO")):
            if os.environ.get(env):
                f = float(os.environ[env])
                if not 0.0 < f <= 1.0:
                    raise ValueError(f"{env} must be in (0, 1], got {f}")
                setattr(s, attr, f)
        mode = os.environ.get("MODELD_DECODE_ATTENTION", "auto").strip().lower()
        if mode not in ("auto", "dispatch", "torch"):
            raise ValueError(f"MODELD_DECODE_ATTENTION must be auto, dispatch or torch, got {mode!r}")
        s.decode_attention = mode
        return s


def _cpu_has_bf16() -> bool:
    """The CPU multiplies bf16 natively (AVX512-BF16 or AMX) and torch's CPU kernels may use it: an ISA limited by
    ATEN_CPU_CAPABILITY=avx2 (or lower) takes the bf16 paths away, so ``auto`` then computes in fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return False
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return native and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class CellConfig:
    """The parts of the Cell CRD's ``.spec`` the engine uses (api/modeld_api/__init__.py is the source)."""

    backend: str = "torch"
    device: str = "cpu"
    model_family: str | None = None
    model_ref: str | None = None
    model_digest: str | None = None
    model_format: str | None = None
    weights: str = "fp32"                 # compute dtype the weights are dequantized to
    weights_storage: str = "auto"         # what the spec asked for (e.g. q4_1: the file's format, dequantized)
    kv: str = "fp32"
    attention_requested: str = "dense"
    prefix_reuse: bool = True
    context_tier: int | None = None       # None: the model's trained context
    kv_memory_mib: int = DEFAULT_KV_MEMORY_MIB
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: dict | None) -> CellConfig:
        spec = dict(spec or {})
        runtime, model, profile = (spec.get("runtime") or {}), (spec.get("model") or {}), (spec.get("profile") or {})
        c = cls(raw=spec)
        # the values the CRD accepts (modeld_api), and no others; what this worker does not serve is refused naming
        # the field, by the same rules the operator applies (modeld_api.served)
        backend = runtime.get("backend") or "torch"
        if backend not in ("torch", "triton"):
            raise errors.BadRequest(f"runtime.backend {backend!r} unknown (torch, triton)", field="runtime.backend")
        gpus = int((spec.get("topology") or {}).get("gpus") or 0)
        if refused := unserved_values(backend, gpus, runtime.get("parallelism") or "single"):
            u = refused[0]
            raise errors.Unsupported(u.message(), field=u.field, value=u.value)
        c.backend, c.device = "torch", "cpu"
        c.model_family, c.model_ref = model.get("family"), model.get("ref")
        c.model_digest, c.model_format = model.get("digest"), model.get("format")
        weights = str(profile.get("weights") or "auto").lower()
        c.weights_storage = weights
        if weights not in _DTYPES:
            # "auto", or a storage format (q4_1, q8_0, ... of a GGUF): the torch backend dequantizes at load and
            # computes in bf16 where the hardware multiplies it natively (half the bytes per decoded token), else fp32
            if weights != "auto" and not re.fullmatch(r"(q\d(_[01k])?(_[sml])?|iq\w+|f16|fp16|gguf|native)", weights):
                raise errors.BadRequest(f"profile.weights {weights!r} unknown (fp32, bf16, auto, or a GGUF "
                                        "quantization such as q4_1)", field="profile.weights")
            weights = "bf16" if _cpu_has_bf16() else "fp32"
        c.weights = {"float32": "fp32", "bfloat16": "bf16"}.get(weights, weights)
        kv = str(profile.get("kv") or "auto").lower()
        c.kv = kv_format(c.weights if kv == "auto" else kv).name  # BadRequest now; canonical name
        att = profile.get("attention") or "dense"
        if att not in SUPPORTED_ATTENTION + SPARSE_ATTENTION:
            raise errors.BadRequest(f"profile.attention {att!r} unknown (dense, block-sparse)",
                                    field="profile.attention")
        c.attention_requested = att
        pr = profile.get("prefixReuse", True)
        if not isinstance(pr, bool):
            raise errors.BadRequest(f"profile.prefixReuse must be true or false, got {pr!r}", field="profile.prefixReuse")
        c.prefix_reuse = pr
        tier = spec.get("contextTier")
        if tier is not None and (isinstance(tier, bool) or not isinstance(tier, int) or tier < 1):
            raise errors.BadRequest(f"contextTier must be a token count, got {tier!r}", field="contextTier")
        c.context_tier = tier
        if spec.get("kvMemoryMiB") is not None:
            c.kv_memory_mib = int(spec["kvMemoryMiB"])
            if c.kv_memory_mib < 1:
                raise errors.BadRequest(f"kvMemoryMiB must be >= 1, got {c.kv_memory_mib}", field="kvMemoryMiB")
        return c
