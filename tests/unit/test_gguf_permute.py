"""GGUF's Q/K row permutation without the model: reverse_permute_qk proven on small random weights against
llama.cpp's pairwise RoPE (the real model's loading is in tests/cell/test_gguf_loader.py)."""

from __future__ import annotations

import pytest
import torch

from modeld_cell.model import ModelArgs, apply_rope, rope_frequencies
from modeld_cell.models.gguf_loader import permute_qk, reverse_permute_qk

pytestmark = pytest.mark.unit


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """llama.cpp's normal RoPE: rotates adjacent pairs (x[2i], x[2i+1]). x: [N, H, D]."""
    ang = pos[:, None].float() * inv[None, :]                       # [N, D/2]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


@pytest.mark.parametrize("n_head,d,cols", [(3, 8, 5), (2, 64, 16)], ids=lambda x: str(x))
def test_unpermuted_weights_with_rotate_half_equal_llamacpp_rope(n_head, d, cols):
    """Proof on a small case: HF weights + rotate_half RoPE == llama.cpp (permuted) weights + pairwise RoPE, after
    undoing the permutation on the output rows. So reverse_permute_qk is exactly the inverse llama.cpp needs."""
    g = torch.Generator().manual_seed(0)
    w_hf = torch.randn(n_head * d, cols, generator=g)
    w_gguf = permute_qk(w_hf, n_head)
    assert torch.equal(reverse_permute_qk(w_gguf, n_head), w_hf)
    x = torch.randn(7, cols, generator=g)
    pos = torch.arange(3, 10)
    args = ModelArgs(head_dim=d, rope_theta=10000.0, n_heads=n_head, n_kv_heads=n_head)
    inv = rope_frequencies(args)
    ang = torch.outer(pos.float(), inv)
    ang = torch.cat([ang, ang], -1)
    q_hf = apply_rope((x @ w_hf.T).view(7, n_head, d), ang.cos(), ang.sin())
    q_cpp = _rope_interleaved((x @ w_gguf.T).view(7, n_head, d), pos, inv)
    # llama.cpp's rows are permuted: map its output back to HF order and compare; scores q.k are then identical
    back = reverse_permute_qk(q_cpp.reshape(7, n_head * d).T, n_head).T.reshape(7, n_head, d)
    torch.testing.assert_close(back, q_hf, atol=1e-5, rtol=1e-5)
