"""The block manager: a session's paged blocks, their refcounts, the prefix index's chain hashes and
copy-on-write (vLLM's KV cache manager, in small). It decides how a prompt gets into a session with the least
compute (``plan``), shares and copies blocks (``attach``, ``make_writable``), names completed blocks in the prefix
index (``register``) and gives back what a session no longer needs (``trim``, ``truncate``). Budget checks raise
Overflow before anything changes. The pool itself is kv_cache.PagedKVCache; the index prefix_index.PrefixIndex.

It holds the engine as ``self.e`` for the live sessions (copy-on-write candidates), the cell's prefixReuse, the
counters and the torch thread that runs block copies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import errors
from .kv_cache import PagedKVCache
from .prefix_index import IDENTITY_KEY_FIELDS, chain_hash, common_prefix

if TYPE_CHECKING:
    from .engine import Engine


@dataclass
class Session:
    id: str
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each full computed block (kv_len // BS of them)
    root: bytes = b""                      # its cache scope's chain root (Engine.scope_root); set at creation
    logits: torch.Tensor | None = None     # [V] fp32, next-token logits after `tokens` (kv_len == len(tokens))
    busy: str | None = None                # the running operation's name
    # the first position whose K/V the recomputing decode step wrote (runner.decoded_kv "recompute"): not a
    # prefill's bits, so never named in the prefix index nor reused by a plan; the engine computes the tokens from
    # here again before any prefill after them or a snapshot (Engine._recompute_decoded). None: all exact
    recompute_from: int | None = None
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    totals: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0,
                                                  "tokens_reused": 0, "tokens_computed": 0})

    @property
    def exact_len(self) -> int:
        """How many leading tokens' K/V are the bits a prefill computes (reusable, nameable in the index)."""
        return self.kv_len if self.recompute_from is None else min(self.kv_len, self.recompute_from)


@dataclass
class Plan:
    """How ensure_prefix serves a prompt: from the session's own KV, or from cached blocks of any session."""

    keep: int                                       # prompt tokens reused
    source: str | None = None                       # "session" | "prefix-cache" | None (miss)
    shared: list[int] = field(default_factory=list)   # prefix-cache: full blocks shared (refcount + 1)
    hashes: list[bytes] = field(default_factory=list)
    cow_src: int | None = None                      # prefix-cache: block whose first cow_len slots are copied
    cow_len: int = 0
    need: int = 0                                   # blocks to allocate
    avail: int = 0                                  # blocks available once the session's own are released



class BlockManager:
    def __init__(self, engine: Engine, kv: PagedKVCache) -> None:
        self.e, self.kv = engine, kv

    def trim(self, s: Session) -> None:
        """Free blocks beyond what ``s.tokens`` needs (after a decode reservation or an interrupted prefill)."""
        if s.recompute_from is not None and s.recompute_from >= s.kv_len:
            s.recompute_from = None                    # nothing the recomputing step wrote is held any more
        del s.hashes[s.exact_len // self.kv.block_size :]
        keep = self.kv.blocks_for(len(s.tokens))
        if len(s.blocks) > keep:
            self.kv.free(s.blocks[keep:][::-1])        # tail first: it is evicted first
            s.blocks = s.blocks[:keep]

    def truncate(self, s: Session, n: int) -> None:
        if n >= len(s.tokens) and s.kv_len == len(s.tokens):
            return
        s.tokens = s.tokens[:n]
        s.kv_len = min(s.kv_len, n)
        s.logits = None
        self.trim(s)

    def grow(self, s: Session, n_tokens: int) -> None:
        """Make s.blocks cover n_tokens (caller checked the budget)."""
        need = self.kv.blocks_for(n_tokens) - len(s.blocks)
        if need > 0:
            s.blocks.extend(self.kv.allocate(need, after=s.blocks[-1] if s.blocks else None, first=len(s.blocks)))

    def fits(self, extra_blocks: int, released: int = 0) -> None:
        if extra_blocks > self.kv.free_blocks + released:
            raise self.e._err(errors.Overflow(
                f"KV memory budget exhausted: need {extra_blocks} more blocks of {self.kv.block_size} tokens, "
                f"{self.kv.free_blocks + released} available ({self.kv.budget_bytes >> 20} MiB budget, "
                f"{len(self.e._sessions)} sessions)", needed_blocks=extra_blocks,
                free_blocks=self.kv.free_blocks + released, budget_bytes=self.kv.budget_bytes))

    def reuse_key(self) -> dict[str, Any]:
        """The cache identity: every field a block's K/V depends on. Hashed into the root of each block chain, and
        compared field by field on restore."""
        a = self.e.model.args
        key: dict[str, Any] = {k: self.e.identity.get(k) for k in IDENTITY_KEY_FIELDS}
        key["kv_layout"] = {"n_layers": a.n_layers, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim}
        key["block_size"] = self.kv.block_size
        return key

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no session references (benchmarks' cold start). Returns how many."""
        return self.kv.clear_cache()

    def register(self, s: Session) -> None:
        """Name the session's newly completed full blocks in the index (after prefill chunks, decode steps, restore);
        only blocks of exact K/V (Session.exact_len): a recomputing step's never are."""
        bs = self.kv.block_size
        full = s.exact_len // bs
        if not self.e.config.prefix_reuse or full <= len(s.hashes):
            return
        idx = self.kv.index
        for i in range(len(s.hashes), full):
            parent = s.hashes[-1] if s.hashes else s.root
            blk = s.tokens[i * bs : (i + 1) * bs]
            h = chain_hash(parent, blk)
            s.hashes.append(h)
            idx.register(s.blocks[i], h, parent, blk)

    def _cow_candidate(self, h: bytes, m: int, want: list[int], exclude: Session) -> tuple[int | None, int]:
        """After m matched full blocks (chain hash h): the block whose first tokens match ``want`` longest, among
        cached blocks continuing h and live sessions' blocks at index m. Returns (block, matching tokens)."""
        if not want:
            return None, 0
        bs = self.kv.block_size
        idx = self.kv.index
        cands: list[tuple[int, Sequence[int]]] = [(b, idx.tokens(b)) for b in idx.children(h)]
        for o in self.e._sessions.values():     # live sessions of the same cache scope only
            if (o is not exclude and o.root == exclude.root and o.exact_len > m * bs and len(o.hashes) >= m
                    and len(o.blocks) > m and (m == 0 or o.hashes[m - 1] == h)):
                cands.append((o.blocks[m], o.tokens[m * bs : min(o.exact_len, (m + 1) * bs)]))
        best, best_n = None, 0
        for b, t in cands:
            n = common_prefix(t, want)
            if n > best_n:
                best, best_n = b, n
        return best, best_n

    def plan(self, s: Session, toks: list[int]) -> Plan:
        """How ensure_prefix gets ``toks`` into s with the least compute; changes nothing. The session's own KV
        (in place) wins ties; otherwise cached full blocks are shared and a mid-block divergence is copied."""
        bs = self.kv.block_size
        ref = self.kv.ref
        # the session's own exact KV always continues; prefixReuse governs only the shared index below
        own = common_prefix(s.tokens[: s.exact_len], toks)
        plan = Plan(keep=own, source="session" if own else None)
        if self.e.config.prefix_reuse and len(toks) > 1:
            cap = len(toks) - 1    # one token always runs: its logits start the decode and no shared slot is rewritten
            shared: list[int] = []
            hashes: list[bytes] = []
            h = s.root                   # the session's scope: blocks of another scope never match
            for i in range(cap // bs):
                hi = chain_hash(h, toks[i * bs : (i + 1) * bs])
                b = self.kv.index.lookup(hi)
                if b is None:
                    break
                shared.append(b)
                hashes.append(hi)
                h = hi
            m = len(shared) * bs
            src, n = self._cow_candidate(h, len(shared), toks[m : min(cap, m + bs)], exclude=s)
            if m + n > own:
                plan = Plan(keep=m + n, source="prefix-cache", shared=shared, hashes=hashes,
                             cow_src=src if n else None, cow_len=n)
        if plan.source == "prefix-cache":
            held_now = set(plan.shared) | ({plan.cow_src} if plan.cow_src is not None else set())
            plan.need = self.kv.blocks_for(len(toks)) - len(plan.shared)
            plan.avail = (self.kv.free_blocks - sum(1 for b in held_now if ref[b] == 0)
                          + sum(1 for b in s.blocks if b not in held_now and ref[b] == 1))
        else:
            kb = self.kv.blocks_for(plan.keep)
            cow = int(plan.keep < len(toks) and plan.keep // bs < kb and ref[s.blocks[plan.keep // bs]] > 1)
            plan.need = self.kv.blocks_for(len(toks)) - kb + cow
            plan.avail = self.kv.free_blocks + sum(1 for b in s.blocks[kb:] if ref[b] == 1)
        return plan

    def cow_need(self, s: Session, pos: int) -> int:
        """1 when writing at ``pos`` needs a private copy of a shared block first, else 0."""
        i = pos // self.kv.block_size
        return int(i < len(s.blocks) and self.kv.ref[s.blocks[i]] > 1)

    async def make_writable(self, s: Session, pos: int) -> None:
        """Before K/V is written at ``pos``: a block others share is copied (copy-on-write), a cached block only this
        session holds is un-named (its content is about to change). Caller checked the budget (``cow_need``)."""
        bs = self.kv.block_size
        i = pos // bs
        del s.hashes[i:]
        if i >= len(s.blocks):
            return
        b = s.blocks[i]
        if self.kv.ref[b] > 1:
            (nb,) = self.kv.allocate(1, first=i)
            s.blocks[i] = nb
            self.kv.free([b])
            self.e._counters["prefix_cache_blocks_copied_total"] += 1
            _, cancelled = await self.e._torch(self.kv.copy_block, b, nb, pos - i * bs)
            if cancelled:
                raise asyncio.CancelledError()
        elif b in self.kv.index:
            self.kv.forget(b)

    async def attach(self, s: Session, toks: list[int], plan: Plan) -> None:
        """Replace what s holds by the plan's shared blocks (+ a copied head of the divergence block) and take the
        blocks the rest of ``toks`` needs, before the copy's await (engine.ensure_prefix); the caller prefills the
        rest. The copy source is held while the copy runs, so nothing evicts or rewrites it."""
        src = plan.cow_src
        self.kv.acquire(plan.shared + ([src] if src is not None else []))
        old = s.blocks
        s.blocks, s.hashes = list(plan.shared), list(plan.hashes)
        s.tokens = toks[: len(plan.shared) * self.kv.block_size]
        s.kv_len, s.logits, s.recompute_from = len(s.tokens), None, None
        self.kv.free(old[::-1])
        self.grow(s, len(toks))
        if src is None:
            return
        try:
            _, cancelled = await self.e._torch(self.kv.copy_block, src, s.blocks[len(plan.shared)], plan.cow_len)
        finally:
            self.kv.free([src])
        self.e._counters["prefix_cache_blocks_copied_total"] += 1
        s.tokens = toks[: plan.keep]
        s.kv_len = plan.keep
        if cancelled:
            raise asyncio.CancelledError()
