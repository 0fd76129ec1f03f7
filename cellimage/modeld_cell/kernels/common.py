"""Triton pieces every kernel family uses. Imports torch-free triton only, like the kernels themselves."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE: exact fp32 products (fp32 inputs) instead of tf32.

    Otherwise a is cast to b's dtype first (probabilities to V's bf16/fp16), as tensor cores need one input dtype."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out
