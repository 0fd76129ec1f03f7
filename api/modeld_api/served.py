"""What the cell worker of this version serves, per value the Cell CRD accepts.

The CRD's schema says what a Cell may say; this module says which of those values the worker can serve today, with
the reason for each one it cannot. Both programs read it: the operator refuses such a Cell where the user sees it (a
``Served=False`` condition and a Warning Event naming the field; no pods, so nothing holds GPUs or crash-loops), and
the worker refuses the same spec at start with ``Unsupported`` naming the field. A value neither listed here nor
rejected by the schema is served; ``tests/unit/test_served.py`` walks every enum value of the CRD against this.

Lossy profiles that the worker serves only when their quality smoke passes on the machine (quantized KV, block-sparse
prefill) are served here: that verdict is a measurement at start (the worker's profile_gate), not a property of the
spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from . import CellSpec


def _v(x: Any) -> str:
    """An enum field's value (defaults stay Enum members even with use_enum_values)."""
    return str(x.value if isinstance(x, Enum) else x)


@dataclass(frozen=True)
class Unserved:
    """A spec value the worker does not serve: the field's path in ``.spec``, the value, and why."""

    field: str
    value: str
    reason: str

    def message(self) -> str:
        return f"spec.{self.field} {self.value!r} is not served: {self.reason}"


# Weight formats the worker computes from: dequantized at load to the compute dtype (bf16 / fp32), or used as is.
SERVED_WEIGHTS = ("fp32", "bf16", "fp16", "q8_0", "q4_1", "q4_k_m")


def unserved(spec: CellSpec) -> list[Unserved]:
    """Every value of ``spec`` this worker version cannot serve, in field order; [] when it serves them all."""
    return unserved_values(_v(spec.runtime.backend), spec.topology.gpus, _v(spec.runtime.parallelism),
                           _v(spec.profile.weights))


def unserved_values(backend: str, gpus: int, parallelism: str, weights: str | None = None) -> list[Unserved]:
    """The rules of ``unserved`` on the values themselves, for a reader that holds a spec as a plain mapping (the
    worker's engine config); ``weights`` None leaves that field to the caller."""
    out: list[Unserved] = []
    if backend == "triton":
        out.append(Unserved("runtime.backend", backend,
                            "this worker version has no triton (CUDA) runtime yet; the torch backend is the CPU cell"))
    elif gpus >= 1:
        out.append(Unserved("topology.gpus", str(gpus),
                            "the torch backend computes on the CPU only: a cell holding GPUs would leave them idle "
                            "(use topology.gpus 0 for a CPU cell)"))
    if parallelism != "single":
        out.append(Unserved("runtime.parallelism", parallelism,
                            "this worker version runs one process per cell; multi-rank shapes are not built yet"))
    if weights is not None and weights not in SERVED_WEIGHTS:
        out.append(Unserved("profile.weights", weights,
                            "weight-only quantized matmuls are not built yet; the worker computes in bf16 or fp32 "
                            f"from one of {', '.join(SERVED_WEIGHTS)}"))
    return out
