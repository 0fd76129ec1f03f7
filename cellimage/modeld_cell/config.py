"""The engine's settings (environment, read once) and the parts of a Cell spec it uses.

``CellConfig.from_spec`` derives the engine's view of a Cell from the spec the API package (modeld_api) validates;
EngineSettings' variables are documented in docs/worker.md (a unit test compares the two).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from modeld_api import CellSpec, enum_value, parse_cell_spec, ranks_of, validation_problems
from modeld_api.served import unserved

from . import errors
from .kernels.sparse_prefill import reference as sparse_ref
from .kv_cache import DEFAULT_KV_MEMORY_MIB, kv_format

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
    # multi-rank cells only: a collective a rank does not join within this many seconds fails (RankLost -> Fatal)
    collective_timeout_s: int = 60                      # MODELD_COLLECTIVE_TIMEOUT_S
    # a directory: each session's committed state at turn boundaries, recovered after the process is lost
    session_store: str = ""                             # MODELD_SESSION_STORE (journal.py); empty: off
    # the CPU cell's weights compute path: auto (measured: autotune.py) or one candidate, e.g. dense-fp32, q4_1-bf16
    weights_path: str = "auto"                          # MODELD_WEIGHTS_PATH
    # a single-rank CPU cell holds its dense fp32/bf16 layer weights oneDNN-packed (model.RowLinear.pack); 0: plain
    pack_weights: bool = True                           # MODELD_PACK_WEIGHTS
    # a quantized kernel serves a head the file keeps in Q8_0 with the int8 kernel (quantize.head_kernel); 0: dense
    int8_head: bool = True                              # MODELD_INT8_HEAD
    # intra-op threads of a one-session decode step: None measures it at start (runner.choose_decode_threads)
    decode_threads: int | None = None                   # MODELD_DECODE_THREADS: auto | a count
    # a one-session CPU decode step as one TorchScript graph (decode_step.py): auto (measured, bits checked at start),
    # script (required), eager (never)
    decode_step: str = "auto"                           # MODELD_DECODE_STEP
    # what a one-session CPU decode step writes to the cache (runner.choose_decoded_kv): exact (the bits a prefill of
    # the token computes, kept), recompute (a faster step; the next prefill computes those tokens again), auto
    decoded_kv: str = "auto"                            # MODELD_DECODED_KV
    # the CPU kernels built at start with the machine's C compiler (kernels/paged_decode/cpu.c, the recomputing
    # step's attention): auto (built where a compiler is, served where measured faster), on (required), off
    cpu_kernels: str = "auto"                           # MODELD_CPU_KERNELS
    # a CPU cell's prefill attention (runner.choose_row_attention): auto (cpu.c's row attention where measured faster
    # than the segmented flash calls), rows (required), segmented (never the row attention)
    prefill_attention: str = "auto"                     # MODELD_PREFILL_ATTENTION

    @classmethod
    def from_env(cls) -> EngineSettings:
        s = cls()
        for attr, env in (("threads", "MODELD_THREADS"), ("prefill_chunk", "MODELD_PREFILL_CHUNK"),
                          ("max_decode_batch", "MODELD_MAX_DECODE_BATCH"),
                          ("sparse_min_tokens", "MODELD_SPARSE_MIN_TOKENS"),
                          ("sparse_max_keep_tokens", "MODELD_SPARSE_MAX_KEEP_TOKENS"),
                          ("collective_timeout_s", "MODELD_COLLECTIVE_TIMEOUT_S")):
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
        s.session_store = os.environ.get("MODELD_SESSION_STORE", "").strip()
        s.weights_path = os.environ.get("MODELD_WEIGHTS_PATH", "").strip() or "auto"
        dt = os.environ.get("MODELD_DECODE_THREADS", "auto").strip().lower() or "auto"
        if dt != "auto":
            if not dt.isdigit() or int(dt) < 1:
                raise ValueError(f"MODELD_DECODE_THREADS must be auto or a count >= 1, got {dt!r}")
            s.decode_threads = int(dt)
        step = os.environ.get("MODELD_DECODE_STEP", "auto").strip().lower() or "auto"
        if step not in ("auto", "script", "eager"):
            raise ValueError(f"MODELD_DECODE_STEP must be auto, script or eager, got {step!r}")
        s.decode_step = step
        dk = os.environ.get("MODELD_DECODED_KV", "auto").strip().lower() or "auto"
        if dk not in ("auto", "exact", "recompute"):
            raise ValueError(f"MODELD_DECODED_KV must be auto, exact or recompute, got {dk!r}")
        s.decoded_kv = dk
        ck = os.environ.get("MODELD_CPU_KERNELS", "auto").strip().lower() or "auto"
        if ck not in ("auto", "on", "off"):
            raise ValueError(f"MODELD_CPU_KERNELS must be auto, on or off, got {ck!r}")
        s.cpu_kernels = ck
        pa = os.environ.get("MODELD_PREFILL_ATTENTION", "auto").strip().lower() or "auto"
        if pa not in ("auto", "rows", "segmented"):
            raise ValueError(f"MODELD_PREFILL_ATTENTION must be auto, rows or segmented, got {pa!r}")
        s.prefill_attention = pa
        s.pack_weights = _switch("MODELD_PACK_WEIGHTS")
        s.int8_head = _switch("MODELD_INT8_HEAD")
        mode = os.environ.get("MODELD_DECODE_ATTENTION", "auto").strip().lower()
        if mode not in ("auto", "dispatch", "torch"):
            raise ValueError(f"MODELD_DECODE_ATTENTION must be auto, dispatch or torch, got {mode!r}")
        s.decode_attention = mode
        return s


def _switch(env: str) -> bool:
    """An on/off variable, on when unset: 1/0, true/false, yes/no, on/off."""
    v = os.environ.get(env, "1").strip().lower()
    if v not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"{env} must be 1 or 0, got {v!r}")
    return v in ("1", "true", "yes", "on")


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


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_compute_dtype() -> str:
    """The compute dtype the torch backend dequantizes stored weights to on this CPU: bf16 where torch multiplies
    it natively (half the bytes per decoded token), else fp32."""
    return "bf16" if _cpu_has_bf16() else "fp32"


def _field_error(e: ValidationError) -> errors.BadRequest:
    """What pydantic found, as a BadRequest naming the first spec field (the CRD's own rule)."""
    problems = validation_problems(e)
    return errors.BadRequest("invalid Cell spec: " + "; ".join(f"{f}: {m}" for f, m in problems),
                             field=problems[0][0])


@dataclass
class CellConfig:
    """The parts of a validated Cell ``.spec`` (modeld_api.CellSpec, the CRD's source) the engine uses. The spec
    is parsed in one place, ``from_spec``: the CRD's rules and values, no aliases of the engine's own."""

    spec: CellSpec
    backend: str = "torch"               # runtime.backend: which model runner (runner.py / triton_runner.py)
    device: str = "cpu"                  # where it computes: loader.resolve_device
    weights: str = "fp32"                 # compute dtype the weights are dequantized to
    weights_storage: str = "fp32"         # what the spec asked for (profile.weights: fp32, int8, q4_1, ...)
    weights_kernel: str = "dense"         # how the weights are multiplied: dense | int8 | q4_1 (autotune.Choice)
    weights_choice: dict | None = None    # the CPU's measured choice of kernel and dtype (autotune.Choice.to_dict)
    weights_head: str | None = None       # a quantized kernel's head: int8 | dense (quantize.head_kernel); None: own
    weights_blocks: bool = False          # the file stores every layer linear in the format's blocks (q4_1): the
                                          # CPU layer step may read them as such (loader, decode_step.q4_blocks)
    weights_head_blocks: bool = False     # and its head in Q8_0 (quantize.q8_0_blocks)
    kv: str = "fp32"
    kv_memory_mib: int = DEFAULT_KV_MEMORY_MIB
    context_tier: int = 0                 # tokens per session: the spec's contextTier (a test sibling may shrink it)
    parallelism: str = "single"           # runtime.parallelism
    ranks: int = 1                        # processes over torch.distributed: runtime.ranks, else topology.gpus
    copy: int = 0                         # data parallel: which of the ranks copies this process is (loader)

    @classmethod
    def from_spec(cls, spec: CellSpec | Mapping[str, Any]) -> CellConfig:
        """The engine config of ``spec``: a CellSpec, or a Cell manifest / bare spec mapping that is validated as
        the apiserver would. A value the CRD rejects raises BadRequest; one this worker does not serve raises
        Unsupported; both name the field (the operator applies the same modeld_api.served rules)."""
        if not isinstance(spec, CellSpec):
            try:
                spec = parse_cell_spec(dict(spec))
            except ValidationError as e:
                raise _field_error(e) from None
        if refused := unserved(spec):
            u = refused[0]
            raise errors.Unsupported(u.message(), field=u.field, value=u.value)
        weights = enum_value(spec.profile.weights)
        compute = weights if weights in _DTYPES else cpu_compute_dtype()  # a stored format: dequantized at load
        mib = spec.kvMemoryMiB if spec.kvMemoryMiB is not None else DEFAULT_KV_MEMORY_MIB
        parallelism = enum_value(spec.runtime.parallelism)
        ranks = ranks_of(spec)
        return cls(spec=spec, backend=enum_value(spec.runtime.backend), weights=compute, weights_storage=weights,
                   kv=kv_format(enum_value(spec.profile.kv)).name, kv_memory_mib=mib, context_tier=spec.contextTier,
                   parallelism=parallelism, ranks=ranks)

    # the spec's fields, as the engine reads them
    @property
    def model_family(self) -> str:
        return self.spec.model.family

    @property
    def model_ref(self) -> str:
        return self.spec.model.ref

    @property
    def model_digest(self) -> str | None:
        return self.spec.model.digest

    @property
    def model_format(self) -> str:
        return enum_value(self.spec.model.format)

    @property
    def adapter(self) -> str | None:
        return self.spec.model.adapter

    @property
    def attention_requested(self) -> str:
        return enum_value(self.spec.profile.attention)

    @property
    def prefix_reuse(self) -> bool:
        return self.spec.profile.prefixReuse

    @property
    def raw(self) -> dict[str, Any]:
        """The spec as JSON (what a Cell's ``.spec`` says once defaulted)."""
        return self.spec.model_dump(mode="json", exclude_none=True)

    def with_profile(self, **profile: Any) -> CellConfig:
        """This cell with ``profile`` fields changed (kv, attention, prefixReuse, ...), validated again."""
        raw = self.raw
        raw["profile"] = {**raw["profile"], **profile}
        out = dataclasses.replace(CellConfig.from_spec(raw), kv_memory_mib=self.kv_memory_mib,
                                  context_tier=self.context_tier, device=self.device)
        if "weights" not in profile:
            out.weights = self.weights    # the compute dtype the device chose (loader.resolve_device) stays
            out.weights_kernel, out.weights_choice = self.weights_kernel, self.weights_choice   # and the kernel
            out.weights_head, out.weights_blocks = self.weights_head, self.weights_blocks
            out.weights_head_blocks = self.weights_head_blocks
        return out
