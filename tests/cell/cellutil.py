"""Helpers for the cell tests: the full-recompute reference and a decode driver (imported by conftest and tests)."""

from __future__ import annotations

import torch

from modeld_cell.engine import Engine
from modeld_cell.kv_cache import PagedKVCache
from modeld_cell.model import AttnMetadata

CONTEXT_TIER = 2048
LOGIT_ATOL = 2e-3     # fp32: chunked / paged / batched vs one-pass recompute differ only in summation order


def full_logits(eng: Engine, tokens: list[int]) -> torch.Tensor:
    """Reference: one causal forward over all tokens in a scratch cache (no reuse, no chunking). [N, V] fp32."""
    a = eng.model.args
    n = len(tokens)
    bs = 16
    cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, eng.kv.fmt, (-(-n // bs)) * bs * eng.kv.bytes_per_token)
    blocks = cache.allocate(cache.num_blocks)
    meta = AttnMetadata("prefill", cache.slots(blocks, 0, n), torch.tensor([blocks], dtype=torch.int32),
                        torch.tensor([n], dtype=torch.int32), [n], bs, [blocks[0]])
    return eng.model(torch.tensor(tokens), torch.arange(n), cache, meta)


def greedy_reference(eng: Engine, tokens: list[int], n_new: int) -> list[int]:
    """Greedy continuation by full recompute at every step (the slow, obviously-correct path)."""
    out: list[int] = []
    seq = list(tokens)
    for _ in range(n_new):
        t = int(full_logits(eng, seq)[-1].argmax())
        out.append(t)
        seq.append(t)
    return out


async def generate(eng: Engine, sid: str, n: int, **kw) -> tuple[list[int], str, object]:
    """Run decode to the end; returns (token ids, text, final event)."""
    from modeld_cell.engine import SamplingParams
    params = kw.pop("params", SamplingParams())
    ids, text, last = [], [], None
    async for ev in eng.decode(sid, params, n, **kw):
        if ev.done:
            last = ev
            text.append(ev.text)
        else:
            ids.append(ev.token_id)
            text.append(ev.text)
    return ids, "".join(text), last
