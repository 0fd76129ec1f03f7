"""What the cell worker of this version serves, per value the Cell CRD accepts.

The CRD's schema says what a Cell may say; this module says which of those values the worker can serve today, with
the reason for each one it cannot. Both programs read it: the operator refuses such a Cell where the user sees it (a
``Served=False`` condition and a Warning Event naming the field; no pods, so nothing holds GPUs or crash-loops), and
the worker refuses the same spec at start with ``Unsupported`` naming the field. A value neither listed here nor
rejected by the schema is served; ``tests/unit/test_served.py`` walks every enum value of the CRD against this.

A served ``runtime.backend: triton`` cell still needs its GPU: a worker that sees no CUDA device refuses the spec at
start, naming runtime.backend, and the Cell's status says so (``Ready=False``, reason ``WorkerRefusedSpec``).

Lossy profiles that the worker serves only when their quality smoke passes on the machine (quantized KV, block-sparse
prefill) are served here: that verdict is a measurement at start (the worker's profile_gate), not a property of the
spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from . import AttentionMode, Backend, CellSpec, KVPrecision, Parallelism, WeightPrecision
from . import enum_value as _v


@dataclass(frozen=True)
class Unserved:
    """A spec value the worker does not serve: the field's path in ``.spec``, the value, and why."""

    field: str
    value: str
    reason: str

    def message(self) -> str:
        return f"spec.{self.field} {self.value!r} is not served: {self.reason}"


# The shapes whose ranks serve one session together (over a process group); data parallel's copies each serve their
# own sessions and serve every profile a single-rank cell serves.
SPLIT_SHAPES = (Parallelism.sharded_kv.value, Parallelism.tensor.value, Parallelism.pipeline.value)

LOSSY_KV = (KVPrecision.int8.value, KVPrecision.fp8_e4m3.value, KVPrecision.int4.value)

# Weight formats the worker computes from: used as is, dequantized at load to the compute dtype (bf16 / fp32), or
# multiplied by a quantized kernel (int8; q4_1 where the CPU cell measures it faster: modeld_cell/autotune.py).
SERVED_WEIGHTS = ("fp32", "bf16", "fp16", "int8", "q8_0", "q4_1", "q4_k_m")
# Formats only a quantized kernel serves: the single-rank (or data-parallel) CPU cell's torch ops.
KERNEL_ONLY_WEIGHTS = ("int8",)

REASONS = {
    "sessionStore.claimName": "a localRun pod (hack/podrunner runs the worker as a local process) mounts no volumes: "
                              "name a directory with sessionStore.hostPath instead",
    "topology.gpus": "the torch backend computes on the CPU only: a cell holding GPUs would leave them idle "
                     "(use topology.gpus 0 for a CPU cell, or runtime.backend triton for a GPU cell)",
    "topology.gpus.single": "a single-process triton cell computes on one GPU: the others would sit idle (use "
                            "topology.gpus 1; multi-rank shapes are not built yet)",
    "runtime.parallelism.gpus": "sharded-kv, tensor, pipeline and data parallel are served over CPU ranks "
                                "(topology.gpus 0, runtime.ranks N; gloo where the ranks talk); their GPU ranks (one "
                                "per GPU, NCCL, runtime.backend triton) are not built yet",
    "runtime.ranks": "a CPU cell with a multi-rank parallelism states how many CPU ranks it runs: runtime.ranks of at "
                     "least 2",
    "profile.kv.sharded": "the sharded-KV runner reads fp32 / bf16 / fp16 / int8 / fp8 caches, not packed rotated int4",
    "profile.attention.sharded": "block-sparse prefill is not built across ranks: a multi-rank cell prefills dense",
    "profile.weights": "no kernel multiplies this format: the worker computes in bf16 or fp32 from one of "
                       f"{', '.join(SERVED_WEIGHTS)}",
    "profile.weights.kernel": "int8 weights are multiplied by torch's CPU weight-only kernel, built for a single-rank "
                              "(or data-parallel) torch cell only; the triton backend and the split shapes compute "
                              "from dequantized formats (q8_0, q4_1, ...)",
    "profile.kv": "the triton backend's prefill kernel reads int8 / fp8 caches, not packed rotated int4 (the torch "
                  "backend serves int4)",
}


def unserved(spec: CellSpec) -> list[Unserved]:
    """Every value of ``spec`` this worker version cannot serve, in field order; [] when it serves them all."""
    backend, parallelism, weights = _v(spec.runtime.backend), _v(spec.runtime.parallelism), _v(spec.profile.weights)
    out: list[Unserved] = []
    gpus = spec.topology.gpus
    if backend == Backend.torch.value and gpus >= 1:
        out.append(Unserved("topology.gpus", str(gpus), REASONS["topology.gpus"]))
    elif backend == Backend.triton.value and gpus == 0:     # the CRD's CEL rule too; here for specs read directly
        out.append(Unserved("topology.gpus", "0", "the triton backend runs on GPUs: topology.gpus must be at least 1"))
    elif backend == Backend.triton.value and gpus > 1 and parallelism == Parallelism.single.value:
        out.append(Unserved("topology.gpus", str(gpus), REASONS["topology.gpus.single"]))
    if parallelism != Parallelism.single.value and gpus >= 1:
        out.append(Unserved("runtime.parallelism", parallelism, REASONS["runtime.parallelism.gpus"]))
    if parallelism != Parallelism.single.value and gpus == 0 and (spec.runtime.ranks or 1) < 2:   # the CEL rule too
        out.append(Unserved("runtime.ranks", str(spec.runtime.ranks), REASONS["runtime.ranks"]))
    if weights not in SERVED_WEIGHTS:
        out.append(Unserved("profile.weights", weights, REASONS["profile.weights"]))
    elif weights in KERNEL_ONLY_WEIGHTS and (backend != Backend.torch.value or parallelism in SPLIT_SHAPES):
        out.append(Unserved("profile.weights", weights, REASONS["profile.weights.kernel"]))
    kv = _v(spec.profile.kv)
    if backend == Backend.triton.value and kv == KVPrecision.int4.value:
        out.append(Unserved("profile.kv", kv, REASONS["profile.kv"]))
    elif parallelism == Parallelism.sharded_kv.value and kv == KVPrecision.int4.value:
        out.append(Unserved("profile.kv", kv, REASONS["profile.kv.sharded"]))
    if parallelism in SPLIT_SHAPES and _v(spec.profile.attention) == AttentionMode.block_sparse.value:
        out.append(Unserved("profile.attention", "block-sparse", REASONS["profile.attention.sharded"]))
    if spec.localRun and spec.sessionStore is not None and spec.sessionStore.claimName:
        out.append(Unserved("sessionStore.claimName", spec.sessionStore.claimName, REASONS["sessionStore.claimName"]))
    return out


# Enum fields of the spec and their enums: what ``not_served`` walks.
ENUM_FIELDS = (("runtime.backend", Backend), ("runtime.parallelism", Parallelism),
               ("profile.weights", WeightPrecision))
_PROBE = {"runtime": {"backend": "torch"}, "topology": {"gpus": 0, "interconnect": "none"},
          "model": {"family": "probe", "ref": "probe"}, "profile": {"weights": "fp32", "kv": "fp32"},
          "contextTier": 512}


def not_served() -> list[str]:
    """What no Cell of this version serves, one line per field, found by running ``unserved`` over every value of
    each enum field of a CPU cell, the GPU counts of each backend, and the KV precisions of a triton cell: the
    capability report's "unsupported"."""
    out = []
    for path, enum in ENUM_FIELDS:   # a multi-rank parallelism is probed on CPU ranks (runtime.ranks 2)
        refused = [v.value for v in enum if any(u.field == path for u in unserved(_probe(path, v.value)))]
        if refused:
            out.append(f"{path}: {', '.join(refused)}")
    if any(u.field == "topology.gpus" for u in unserved(_probe("topology.gpus", 1))):
        out.append("topology.gpus: >= 1 with runtime.backend torch")
    if any(u.field == "topology.gpus" for u in unserved(_probe("topology.gpus", 2, backend="triton"))):
        out.append("topology.gpus: >= 2 with runtime.backend triton and runtime.parallelism single")
    triton_kv = [v.value for v in KVPrecision
                 if any(u.field == "profile.kv" for u in unserved(_probe("profile.kv", v.value, backend="triton")))]
    if triton_kv:
        out.append(f"profile.kv: {', '.join(triton_kv)} with runtime.backend triton")
    triton_weights = [v.value for v in WeightPrecision
                      if any(u.field == "profile.weights" for u in unserved(_probe("profile.weights", v.value,
                                                                                    backend="triton")))
                      and not any(u.field == "profile.weights" for u in unserved(_probe("profile.weights", v.value)))]
    if triton_weights:
        out.append(f"profile.weights: {', '.join(triton_weights)} with runtime.backend triton")
    for shape in (*SPLIT_SHAPES, Parallelism.data.value):
        cpu_ranks = {"runtime": {"backend": "torch", "parallelism": shape, "ranks": 2}}
        if any(u.field == "runtime.parallelism" for u in unserved(_probe(
                "topology.gpus", 2, sections={"runtime": {"backend": "triton", "parallelism": shape},
                                              "topology": {"gpus": 2, "interconnect": "nvlink"}}))):
            out.append(f"runtime.parallelism: {shape} with topology.gpus >= 1")
        profile_enums: tuple[tuple[str, type[Enum]], ...] = (("profile.kv", KVPrecision),
                                                             ("profile.attention", AttentionMode),
                                                             ("profile.weights", WeightPrecision))
        for path, values in profile_enums:
            refused = [v.value for v in values    # (a value no cell serves has its own line above)
                       if any(u.field == path for u in unserved(_probe(path, v.value, sections=cpu_ranks)))
                       and not any(u.field == path for u in unserved(_probe(path, v.value)))]
            if refused:
                out.append(f"{path}: {', '.join(refused)} with runtime.parallelism {shape}")
    return out


def _probe(path: str, value: Any, backend: str = "torch", sections: dict[str, dict] | None = None) -> CellSpec:
    spec: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in _PROBE.items()}
    if backend == "triton":
        spec["runtime"] = {"backend": "triton"}
        spec["topology"] = {"gpus": 1, "interconnect": "none"}
    for k, v in (sections or {}).items():
        spec[k] = dict(v)
    section, key = path.split(".")
    spec[section][key] = value
    if path == "runtime.parallelism" and value != Parallelism.single.value:
        spec["runtime"]["ranks"] = 2
    return CellSpec.model_validate(spec)
