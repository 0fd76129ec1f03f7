"""The decode scheduler: every decode request of every session joins one loop that runs a single batched forward
per step (continuous batching: a request joins or leaves between steps), with deadlines, cancellation, stop tokens
and stop strings, and the per-token events a request's consumer reads.

The engine (its facade) validates a decode, reserves its blocks and ``submit``s it; the scheduler samples, emits,
finishes and trims. It holds the engine as ``self.e`` for the parts it drives: the session records, the runner's
decode forward on the torch thread, the counters and the tokenizer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import errors
from .contract import DecodeEvent, SamplingParams, Trace

if TYPE_CHECKING:
    from .engine import Engine


def _deadline_passed(deadline: float | None) -> bool:
    """Deadlines are absolute ``time.monotonic()`` seconds; values above 1e9 are read as ``time.time()`` epochs."""
    if deadline is None:
        return False
    return (time.time() if deadline > 1e9 else time.monotonic()) >= deadline


@dataclass
class DecodeReq:
    session: Any            # blocks.Session
    params: SamplingParams
    granted: int
    stop_ids: set[int]
    stop: list[str]
    deadline: float | None
    gen: torch.Generator | None
    trace: Trace
    t0: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    generated: list[int] = field(default_factory=list)
    emitted: int = 0                       # characters of decoded text already sent
    t_last: float = 0.0
    cancelled: bool = False
    done: bool = False


def sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """logits: [V] fp32. Greedy when temperature == 0, else temperature -> top-k -> top-p -> multinomial."""
    if p.temperature == 0.0:
        return int(torch.argmax(logits))
    # Any temperature in (0, 10] is valid. Shifted so the largest logit is 0 (softmax does not change) and divided by
    # at least the dtype's smallest normal (1.8e-280 is 0 in fp32), a tiny one sends the others to -inf: greedy in
    # effect. Before, logits / 1.8e-280 overflowed to inf, softmax gave NaN and multinomial raised (the fuzz test).
    x = (logits - logits.max()) / max(p.temperature, torch.finfo(logits.dtype).tiny)
    if 0 < p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sx, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sx, -1)
        drop = (torch.cumsum(probs, -1) - probs) > p.top_p   # keep the smallest head whose mass reaches top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sx)
    return int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen))


def greedy_ids(logits: list[torch.Tensor]) -> list[int]:
    """argmax of each [V] logits row, batched: one device op and one read of the ids (ties: the first index, as
    sample_token's greedy argmax)."""
    if not logits:
        return []
    dev = logits[0].device
    return torch.stack([x.to(dev) for x in logits]).argmax(-1).tolist()


def grant(e: Engine, s: Any, max_tokens: int) -> tuple[int, dict | None]:
    """How many of ``max_tokens`` the session may generate: clamped to the context tier, then to the KV budget
    (the clamp is reported in the trace, not an error). Overflow when none fit although some were asked."""
    granted, clamped = max_tokens, None
    room = e.context_tier - len(s.tokens)
    if granted > room:
        granted, clamped = room, {"field": "max_tokens", "requested": max_tokens, "granted": room,
                                  "reason": "context tier"}
    rerun = s.logits is None and s.kv_len == len(s.tokens)        # the last token runs again first
    cow = e.blocks.cow_need(s, s.kv_len - 1 if rerun else s.kv_len)
    mem_room = (len(s.blocks) + e.kv.free_blocks - cow) * e.kv.block_size - len(s.tokens)
    if granted > mem_room:
        granted, clamped = mem_room, {"field": "max_tokens", "requested": max_tokens, "granted": mem_room,
                                      "reason": "kv memory budget"}
    if granted <= 0 and max_tokens > 0:
        why = "context tier" if room <= 0 else "KV memory budget"
        raise e._err(errors.Overflow(f"no room to generate: the session holds {len(s.tokens)} tokens and the "
                                     f"{why} is full", session_id=s.id, session_tokens=len(s.tokens),
                                     context_tier=e.context_tier, reason=why))
    return granted, clamped


class DecodeScheduler:
    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.reqs: list[DecodeReq] = []          # running decode requests, in rotation order
        self.task: asyncio.Task | None = None    # the loop, on the event loop that first decoded

    def submit(self, req: DecodeReq) -> None:
        """Join the loop (starting it on this event loop if it is not running there)."""
        self.reqs.append(req)
        t = self.task
        if t is None or t.done() or t.get_loop() is not asyncio.get_running_loop():
            self.task = asyncio.get_running_loop().create_task(self._loop())

    def shutdown(self) -> None:
        if self.task is not None:
            self.task.cancel()


    def emit(self, req: DecodeReq, tok: int) -> None:
        """Record a sampled token in the session (pending: no K/V yet) and send its event or finish."""
        s = req.session
        now = time.perf_counter()
        if not req.generated:
            req.trace.first_output_ms = round((now - req.t0) * 1e3, 3)
        else:
            req.trace.decode_ms_per_token.append(round((now - req.t_last) * 1e3, 3))
        req.t_last = now
        req.generated.append(tok)
        s.tokens.append(tok)
        s.logits = None
        self.e._counters["generation_tokens_total"] += 1
        if tok in req.stop_ids:
            self.finish(req, "stop")
            return
        text = self.e.tokenizer.decode(req.generated)
        if req.stop:
            lo = max(0, req.emitted - max(len(x) for x in req.stop))
            hits = [i for i in (text.find(x, lo) for x in req.stop) if i >= 0]
            if hits:
                cut = min(hits)
                if cut > req.emitted:
                    req.queue.put_nowait(DecodeEvent(token_id=tok, text=text[req.emitted:cut]))
                    req.emitted = cut
                self.finish(req, "stop")
                return
        safe = len(text)
        while safe > req.emitted and text[safe - 1] == "\ufffd":   # bytes of an unfinished UTF-8 character
            safe -= 1
        for x in req.stop:                                           # hold back a possible stop-string prefix
            for k in range(min(len(x) - 1, safe - req.emitted), 0, -1):
                if text[safe - k : safe] == x[:k]:
                    safe -= k
                    break
        req.queue.put_nowait(DecodeEvent(token_id=tok, text=text[req.emitted:safe]))
        req.emitted = safe
        if len(req.generated) >= req.granted:
            self.finish(req, "length")

    def finish(self, req: DecodeReq, reason: str | None, error: errors.ContractError | None = None) -> None:
        if req.done:
            return
        req.done = True
        s = req.session
        if req in self.reqs:
            self.reqs.remove(req)
        self.e.blocks.trim(s)
        tail = ""
        if reason == "length" and req.generated:
            text = self.e.tokenizer.decode(req.generated)
            tail, req.emitted = text[req.emitted:], len(text)
        tr = self.e._trace(s, req.t0, completion_tokens=len(req.generated), clamped=req.trace.clamped,
                         first_output_ms=req.trace.first_output_ms,
                         decode_ms_per_token=req.trace.decode_ms_per_token,
                         tokens_computed=req.trace.tokens_computed, prefill_ms=req.trace.prefill_ms)
        if error is not None:
            error.details.update(partial_output=self.e.tokenizer.decode(req.generated), token_ids=list(req.generated),
                                 completion_tokens=len(req.generated), trace=tr.to_dict())
            req.queue.put_nowait(error)
        elif reason is not None:
            req.queue.put_nowait(DecodeEvent(text=tail, done=True, finish_reason=reason, trace=tr))
        req.finished.set()

    async def _loop(self) -> None:
        try:
            await self._steps()
        except Exception as e:  # a bug here must not leave consumers waiting forever
            err = self.e._fatal(e)
            for r in list(self.reqs):
                self.finish(r, None, errors.Fatal(err.message))

    async def _steps(self) -> None:
        while self.reqs:
            for r in list(self.reqs):
                if r.cancelled:
                    self.finish(r, None)
                elif _deadline_passed(r.deadline):
                    self.finish(r, None, self.e._err(errors.Timeout(
                        f"deadline passed after {len(r.generated)} generated tokens", session_id=r.session.id)))
            # sample where logits are known: every greedy request in one argmax on the device and one read of the ids
            # (the only host sync of a step); a sampled one reads its logits back for its CPU generator
            known = [r for r in self.reqs if r.session.logits is not None and r.session.kv_len == len(r.session.tokens)]
            greedy = [r for r in known if r.params.temperature == 0.0]
            for r, tok in zip(greedy, greedy_ids([r.session.logits for r in greedy]), strict=True):
                self.emit(r, tok)
            for r in known:
                if r.params.temperature != 0.0:
                    self.emit(r, sample_token(r.session.logits.float().cpu(), r.params, r.gen))
            batch = [r for r in self.reqs if r.session.kv_len == len(r.session.tokens) - 1]
            batch = batch[: self.e.settings.max_decode_batch]
            if not batch:
                await asyncio.sleep(0)
                continue
            toks = [r.session.tokens[-1] for r in batch]
            pos = [r.session.kv_len for r in batch]
            tables = [list(r.session.blocks) for r in batch]
            try:
                logits, _ = await self.e._torch(self.e.runner.decode, toks, pos, tables)
            except errors.Fatal as e:
                for r in list(self.reqs):
                    self.finish(r, None, errors.Fatal(e.message))
                return
            self.e._counters["decode_steps_total"] += 1
            self.e._counters["decode_batch_tokens_total"] += len(batch)
            exact = self.e.runner.writes_exact(len(batch))
            for i, r in enumerate(batch):
                if not exact and r.session.recompute_from is None:
                    r.session.recompute_from = r.session.kv_len     # computed again before the next prefill
                r.session.kv_len += 1
                r.session.logits = logits[i]
                self.e.blocks.register(r.session)
            # rotate so a batch cap never starves the same requests
            if len(self.reqs) > len(batch):
                for r in batch:
                    if r in self.reqs:
                        self.reqs.remove(r)
                        self.reqs.append(r)
