"""Tensor parallel's head split (parallel/tensor.head_split): whole GQA groups per rank, KV heads replicated when
the degree exceeds them, anything else refused naming runtime.ranks."""

from __future__ import annotations

import pytest

from modeld_cell import errors
from modeld_cell.parallel.tensor import head_split

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("hq, hkv, ranks", [(9, 3, 1), (9, 3, 3), (9, 3, 9), (32, 8, 2), (32, 8, 4), (32, 8, 16),
                                            (14, 2, 2), (14, 2, 14)])
def test_every_query_head_is_on_one_rank_with_the_kv_head_it_reads(hq, hkv, ranks):
    split = head_split(hq, hkv, ranks)
    group = hq // hkv
    assert sorted(h for q, _ in split for h in q) == list(range(hq))          # each query head exactly once
    assert len({len(q) for q, _ in split}) == 1 and len({len(kv) for _, kv in split}) == 1   # balanced
    for q, kv in split:
        assert {h // group for h in q} == set(kv)                              # the KV heads its queries read
        # locally, consecutive groups of (query heads / KV heads) read one KV head each: model.py's GQA layout
        assert all((h - q.start) // (len(q) // len(kv)) == h // group - kv.start for h in q)
    assert {h for _, kv in split for h in kv} == set(range(hkv))


@pytest.mark.parametrize("hq, hkv, ranks", [(9, 3, 2), (9, 3, 6), (32, 8, 3), (14, 2, 4)])
def test_a_degree_the_heads_do_not_split_by_is_refused_naming_runtime_ranks(hq, hkv, ranks):
    with pytest.raises(errors.Unsupported) as ei:
        head_split(hq, hkv, ranks)
    assert ei.value.details["field"] == "runtime.ranks" and "GQA" in ei.value.message
