"""Chunked prefill: a session's new tokens run through the model in chunks on the torch thread, each chunk committed
to the session as it lands, so a deadline or a cancellation between chunks leaves the session holding a prefix of
what was asked (never anything else). Block-sparse cells take one chunk where the sparse path qualifies
(sparse_policy.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import torch

from . import errors
from .blocks import Session
from .contract import elapsed_ms
from .scheduler import _deadline_passed

if TYPE_CHECKING:
    from .engine import Engine


def forward_chunk(e: Engine, tokens: list[int], start: int, blocks: list[int],
                  att: list[dict] | None = None) -> tuple[torch.Tensor, float]:
    """(torch thread) tokens at positions [start, start+T) of a session with block table ``blocks``; returns
    (logits [V], t0). A block-sparse cell appends the chunk's record (SparsePolicy.record) to ``att``."""
    sparse, reason = e.sparse_policy.meta(len(tokens), start) if e.sparse else (None, None)
    logits, t_start, log = e.runner.prefill(tokens, start, blocks, sparse)
    if e.sparse and att is not None:
        att.append(e.sparse_policy.record(len(tokens), start, reason, log))
    return logits, t_start


async def prefill(e: Engine, s: Session, new: list[int], deadline: float | None,
                  att: list[dict] | None = None) -> tuple[float, float | None]:
    """Run ``new`` (appended after s.tokens[:s.kv_len]) through the model in chunks, committing each chunk.

    Blocks must already cover the result. Returns (prefill_ms, queue_ms). Raises Timeout between chunks.
    A block-sparse cell prefills ``new`` in ONE chunk whenever that chunk qualifies for the sparse path (after a
    past or not: SparsePolicy.meta), since sparsity pays off only on long chunks; otherwise it chunks as usual.
    ``att`` collects each chunk's attention record.
    """
    t0 = time.perf_counter()
    queue_ms: float | None = None
    chunk = e.settings.prefill_chunk
    if e.sparse and e.sparse_policy.meta(len(new), s.kv_len)[0] is not None:
        chunk = max(chunk, len(new))
    e._running_prefills += 1
    try:
        for i in range(0, len(new), chunk):
            if _deadline_passed(deadline):
                raise e._err(errors.Timeout(
                    f"deadline passed during prefill after {i} of {len(new)} tokens; the session keeps the "
                    f"{len(s.tokens)} tokens computed so far", session_id=s.id, session_tokens=len(s.tokens),
                    tokens_computed=i, partial_output=""))
            part = new[i : i + chunk]
            (logits, t_job), cancelled = await e._torch(forward_chunk, e, part, s.kv_len, list(s.blocks), att)
            if queue_ms is None:
                queue_ms = round((t_job - t0) * 1e3, 3)
            # commit the chunk: its K/V are in the cache
            if s.kv_len < len(s.tokens):          # the pending token was the chunk's first token
                s.tokens = s.tokens[: s.kv_len]
            s.tokens.extend(part)
            s.kv_len = len(s.tokens)
            s.logits = logits
            e.blocks.register(s)
            e._prefill_tokens += len(part)
            e._prefill_s += time.perf_counter() - t_job
            if cancelled:
                raise asyncio.CancelledError()
    finally:
        e._running_prefills -= 1
    return elapsed_ms(t0), queue_ms
