"""The decode scheduler's batched greedy pick: one argmax over the stacked rows, the same ids (ties included) as the
per-row greedy sample_token."""

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
