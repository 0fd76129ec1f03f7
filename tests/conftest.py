"""Shared test plumbing. Tiers (markers): unit, kernels, cell, e2e; `pytest` runs them all."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on machines without CUDA; this must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # the operator-only environment has no torch
    pass
