"""The decode scheduler's batched greedy pick: one argmax over the stacked rows, the same ids (ties included) as the
per-row greedy sample_token; and sample_token at the edges of its parameters' ranges."""

from __future__ import annotations

import pytest
import torch

from modeld_cell.contract import SamplingParams
from modeld_cell.scheduler import greedy_ids, sample_token

pytestmark = pytest.mark.unit


def test_batched_greedy_equals_per_row_greedy_ties_first():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(97, generator=g) for _ in range(5)]
    rows[1][[3, 40]] = 9.0                    # a tie: the first index wins, as torch.argmax of one row
    rows[4] = torch.zeros(97)                 # all equal: index 0
    want = [sample_token(r, SamplingParams(), None) for r in rows]
    assert greedy_ids(rows) == want and want[1] == 3 and want[4] == 0
    assert greedy_ids([]) == []


@pytest.mark.parametrize("temperature", [5e-324, 1.8e-280, 1e-30, 1e-6])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (7, 1.0), (0, 0.5), (7, 1e-300)])
def test_a_tiny_temperature_samples_the_argmax(temperature, top_k, top_p):
    """Any temperature in (0, 10] is valid: a tiny one is greedy in effect, never a NaN (found by the fuzz test:
    logits / 1.8e-280 overflowed to inf, softmax gave NaN and multinomial raised, which marked the worker fatal)."""
    logits = torch.randn(97, generator=torch.Generator().manual_seed(1)) * 30
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    assert sample_token(logits, p, torch.Generator().manual_seed(0)) == int(logits.argmax())
