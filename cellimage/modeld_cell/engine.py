"""The engine: the session contract (ensure_prefix, prefill_suffix, decode, snapshot/restore) as a facade over
its parts: blocks.py (paged blocks, refcounts, prefix index, copy-on-write), prefill.py (chunked prefill),
scheduler.py (the batched decode loop), runner.py (the backend's forward passes), snapshot.py, capability.py.
docs/engine-interface.md describes each part, the concurrency model and the session state.

Concurrency: bookkeeping runs on the event-loop thread, torch work on ONE worker thread; requests on one session are
serialized (a second one gets Conflict at once); decode requests of all sessions share one batched forward per step.
A session holds ``tokens``, of which ``kv_len`` (len or len - 1: the last sampled token runs only when more is
asked) have K/V in its ``blocks``; ``logits`` are the next-token logits after ``tokens`` when known.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from modeld_api import CellSpec

from . import capability, errors, snapshot
from .blocks import BlockManager, Plan, Session
from .config import SPARSE_ATTENTION, SPARSE_BLOCK, CellConfig, EngineSettings
from .contract import DecodeEvent, SamplingParams, Trace, elapsed_ms, validate_decode, validate_tokens
from .journal import Journal
from .kv_cache import PagedKVCache
from .loader import DEFAULT_QUALITY_CACHE, load_engine, probe_model, serveable_tier, sibling_engine
from .model import Transformer
from .prefill import prefill
from .prefix_index import ENGINE_IDENTITY_FIELDS, common_prefix, root_hash
from .runner import TorchThread, runner_for
from .scheduler import DecodeReq, DecodeScheduler, grant, sample_token
from .sparse_policy import SparsePolicy, sparse_settings

if TYPE_CHECKING:
    from .tokenizer import Tokenizer  # the HF tokenizers package: only where a checkpoint brings a vocabulary

# The engine's public names; the contract types and the config live in contract.py / config.py and are re-exported.
__all__ = ["SPARSE_BLOCK", "CellConfig", "DecodeEvent", "Engine", "EngineSettings", "SamplingParams", "Trace",
           "sample_token"]

log = logging.getLogger("modeld_cell.engine")


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, kv: PagedKVCache, config: CellConfig,
                 identity: dict[str, Any], settings: EngineSettings | None = None, runner: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.config = config
        self.identity = identity
        self.settings = settings or EngineSettings.from_env()
        self.ready = True
        self.fatal_reason: str | None = None
        a = model.args
        self.context_tier = serveable_tier(model, config.context_tier)
        probe_model(model)                               # what bitwise reuse rests on, once per loaded model
        self.vocab_size = a.vocab_size
        self._sessions: dict[str, Session] = {}
        self._thread = TorchThread(self.settings.threads)   # the one thread torch work runs on (runner.py)
        self.scheduler = DecodeScheduler(self)       # the batched decode loop (scheduler.py)
        self.blocks = BlockManager(self, kv)         # blocks, refcounts, prefix index, copy-on-write (blocks.py)
        self._running_prefills = 0
        # builds attention metadata, owns the kernel choice: runner.py (torch), triton_runner.py (triton)
        # (a multi-rank cell's loader passes its driving runner: parallel/ranks.py)
        self.runner = runner if runner is not None else runner_for(config.backend)(model, kv)
        # What this engine computes with, named in the identity by the engine itself, not its caller (each changes
        # the K/V bits past the first layer): cpu.c's row attention where this engine's pool takes it (a sibling with
        # a quantized pool keeps the segmented calls); a block-sparse cell's sparse settings (which chunks run
        # sparse, and how); a decode through kernels.dispatch (MODELD_DECODE_ATTENTION=dispatch: a decoded token's
        # K/V within the kernel's tolerance of a prefill's, not its bits). None where the engine computes the default.
        self.identity = {k: v for k, v in identity.items() if k not in ENGINE_IDENTITY_FIELDS}
        if rows := getattr(self.runner, "rows_attention", None):
            self.identity["prefill_attention"] = rows
        if self.sparse:
            self.identity["prefill_sparse"] = sparse_settings(self.settings)
        if self.settings.decode_attention == "dispatch":
            self.identity["decode_attention"] = "dispatch"
        self.startup: dict | None = None                 # a device backend's start-up forward (loader.load_engine)
        # while the loader gates a quantized-weights cell: builds the checkpoint in fp32 (profile_gate's reference)
        self.fp32_weights: Callable[[], Transformer] | None = None
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "prefix_cache_queries": 0,
                          "prefix_cache_hits": 0, "tokens_computed_total": 0, "requests_total": 0,
                          "decode_steps_total": 0, "decode_batch_tokens_total": 0,
                          "prefix_cache_blocks_shared_total": 0, "prefix_cache_blocks_copied_total": 0,
                          "decoded_tokens_recomputed_total": 0}
        self._errors: dict[str, int] = {}
        self._root = root_hash(self.reuse_key())       # every block chain of this identity starts here
        self._scope_roots: dict[str, bytes] = {}        # cache_salt -> its scope's root (scope_root)
        # MODELD_SESSION_STORE: committed session state at turn boundaries, recovered after the process is lost
        self.journal = Journal(self.settings.session_store, self._root) if self.settings.session_store else None
        self._journal_errors = 0
        self._prefill_tokens, self._prefill_s = 0, 0.0  # measured prefill rate, for the time-saved estimate
        # block-sparse cells: which chunks run sparse, their records and counts (sparse_policy.py)
        self.sparse_policy = SparsePolicy(self.settings, a.n_layers, config.attention_requested)
        # profile_gate verdicts on this cell's lossy profiles (from_cell fills it; [] when none is gated)
        self.quality: list[dict[str, Any]] = []

    # ---- construction

    @classmethod
    def from_cell(cls, spec: CellSpec | Mapping[str, Any], model_path: str | None = None,
                  settings: EngineSettings | None = None, quality_cache: str | None = DEFAULT_QUALITY_CACHE,
                  device: str | None = None, layers: int | None = None, gate: bool = True) -> Engine:
        """Load the cell's weights and build its engine. A lossy profile (quantized KV, block-sparse prefill) is served
        only if its quality smoke, measured on this machine (cached under ``quality_cache``; None: not cached),
        passes: else errors.Unsupported naming the field and the measured numbers (profile_gate.py). ``device``
        None: the backend's (loader.resolve_device); "cpu" with backend triton: the interpreter proof. ``layers``:
        the first that many layers only (proofs on a stated prefix of the model). ``gate=False``: no quality smoke
        (exactness proofs of a lossy format against itself elsewhere; the worker always gates)."""
        return load_engine(cls, spec, model_path, settings, quality_cache, device, layers, gate)

    def sibling(self, kv: str | None = None, attention: str | None = None, kv_mib: int | None = None,
                settings: EngineSettings | None = None, identity: dict | None = None, context_tier: int | None = None,
                model: Transformer | None = None, **profile: Any) -> Engine:
        """Another engine over this one's loaded weights and tokenizer, with its own KV pool (``kv_mib`` MiB of
        precision ``kv``), attention mode, settings, context tier and profile fields (``profile``: e.g.
        prefixReuse=False) on top of this cell's. No quality gate runs: quality smokes and tests build their
        candidates with it. ``kv_mib`` and ``context_tier`` may go below the CRD's minimums (a smoke holds a few
        hundred tokens; a test overflows a 64-token tier): they size this in-process engine, no Cell says them.
        ``model``: another build of the same checkpoint instead of this one's weights (a smoke's fp32 reference)."""
        eng = sibling_engine(self, kv, attention, kv_mib, settings, identity, context_tier, profile, model)
        eng.journal = None          # a smoke's or a test's engine: its sessions are not the cell's to keep
        return eng

    def on_torch_thread(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the torch thread, waited for (start-up work outside the event loop)."""
        return self._thread.call(fn, *args)

    def shutdown(self) -> None:
        """Stop the decode loop and the torch thread (tests, process exit); a driving runner's followers too."""
        self.scheduler.shutdown()
        self._thread.shutdown()
        if hasattr(self.runner, "stop"):   # a driving runner: stops the followers (unless a rank is lost), leaves
            try:
                self.runner.stop(send=self.ready)
            except RuntimeError:           # a lost rank: the launcher stops the others
                pass

    # ---- small helpers

    def _check_ready(self) -> None:
        if not self.ready:
            raise errors.Fatal(f"engine is not ready: {self.fatal_reason}", reason=self.fatal_reason)

    def _err(self, e: errors.ContractError) -> errors.ContractError:
        self._errors[e.kind] = self._errors.get(e.kind, 0) + 1
        return e

    def _validate_tokens(self, tokens: Any, name: str = "tokens") -> list[int]:
        try:
            return validate_tokens(tokens, self.vocab_size, name)
        except errors.BadRequest as e:
            raise self._err(e) from None

    def _session(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise self._err(errors.NotFound(f"session {session_id!r} not found", session_id=session_id))
        return s

    def _claim(self, s: Session, op: str) -> None:
        if s.busy is not None:
            raise self._err(errors.Conflict(f"session {s.id!r} is busy ({s.busy} running); requests on one session "
                                            "are serialized", session_id=s.id, running=s.busy))
        s.busy = op
        s.last_used = time.time()

    def _trace(self, s: Session, t0: float, **kw: Any) -> Trace:
        tr = Trace(session_id=s.id, **kw)
        tr.session_tokens = len(s.tokens)
        tr.kv_bytes = len(s.blocks) * self.kv.block_bytes
        tr.total_ms = elapsed_ms(t0)
        for k in ("prompt_tokens", "completion_tokens", "tokens_reused", "tokens_computed"):
            s.totals[k] += getattr(tr, k)
        tr.totals = dict(s.totals)
        self._counters["prompt_tokens_total"] += tr.prompt_tokens
        self._counters["tokens_computed_total"] += tr.tokens_computed
        return tr

    @property
    def sparse_stats(self) -> dict[str, Any]:
        return self.sparse_policy.stats

    @property
    def sparse(self) -> bool:
        """The cell asked for block-sparse prefill."""
        return self.config.attention_requested in SPARSE_ATTENTION

    def _prefill_rate(self) -> float | None:
        """Measured prefill tokens/s of this engine so far (None before the first prefill)."""
        return self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else None

    def _reuse_info(self, plan: Plan, lookup_ms: float) -> dict[str, Any]:
        rate = self._prefill_rate()
        return {"hit": plan.keep > 0, "source": plan.source, "tokens_reused": plan.keep,
                "bytes_reused": plan.keep * self.kv.bytes_per_token, "blocks_shared": len(plan.shared),
                "blocks_copied": int(plan.cow_src is not None), "lookup_ms": lookup_ms,
                "time_saved_ms_est": round(plan.keep / rate * 1e3, 3) if rate and plan.keep else 0.0}

    def _fatal(self, e: BaseException) -> errors.Fatal:
        self.ready = False
        self.fatal_reason = f"{type(e).__name__}: {e}"
        return self._err(errors.Fatal(f"backend failure, worker marked not ready: {self.fatal_reason}"))

    async def _torch(self, fn: Any, *args: Any) -> tuple[Any, bool]:
        """fn on the torch thread: (result, cancelled) as TorchThread.run; a backend exception marks the engine
        not ready and raises Fatal."""
        try:
            return await self._thread.run(fn, *args)
        except (errors.ContractError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise self._fatal(e) from e

    def reuse_key(self) -> dict[str, Any]:
        """The cache identity: every field a block's K/V depends on (blocks.BlockManager.reuse_key)."""
        return self.blocks.reuse_key()

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no session references (benchmarks' cold start). Returns how many."""
        return self.blocks.clear_prefix_cache()

    # ---- the contract

    def scope_root(self, cache_salt: str | None) -> bytes:
        """The chain root of a cache scope: the identity's for requests without a salt (one shared scope), else the
        identity's hashed with the client's ``cache_salt`` (vLLM's name), so blocks of different scopes never match
        and no trace reports reuse of another scope's tokens (docs/reuse.md "Cache scopes")."""
        if not cache_salt:
            return self._root
        root = self._scope_roots.get(cache_salt)
        if root is None:
            root = root_hash({**self.reuse_key(), "cache_salt": cache_salt})
            if len(self._scope_roots) < 65536:           # a memo, bounded; recomputing is cheap
                self._scope_roots[cache_salt] = root
        return root

    def scoped_session(self, session_id: str, cache_salt: str | None) -> Session | None:
        """The live session, checked against ``cache_salt``: a session keeps the scope it was created in
        (Conflict, field cache_salt, when a request names another); None when there is none."""
        s = self._sessions.get(session_id)
        if s is not None and cache_salt is not None and self.scope_root(cache_salt) != s.root:
            raise self._err(errors.Conflict(
                f"session {session_id!r} was created under another cache_salt; a session keeps its cache scope "
                "(close it, or use another session id)", field="cache_salt", session_id=session_id))
        return s

    async def ensure_prefix(self, session_id: str, tokens: list[int], deadline: float | None = None,
                            cache_salt: str | None = None) -> Trace:
        """Create the session if absent (in the cache scope of ``cache_salt``); afterwards its KV holds exactly
        ``tokens``.

        Keeps the longest common prefix with what it holds, or with cached blocks of any session (prefixReuse),
        drops the rest, computes the remainder. Overflow (context tier or memory) is raised before anything changes. On Timeout or
        cancellation mid-prefill the session holds a prefix of ``tokens`` (details.session_tokens), never
        anything else; calling again continues from there.
        """
        s, t0, tr_kw = await self._ensure_prefix(session_id, tokens, deadline, cache_salt)
        tr = self._trace(s, t0, **tr_kw)
        self._commit(s)                                  # after the trace: the stored totals count this request
        return tr

    async def _ensure_prefix(self, session_id: str, tokens: list[int], deadline: float | None,
                             cache_salt: str | None) -> tuple[Session, float, dict[str, Any]]:
        """ensure_prefix's work: (the session, its start time, the trace's fields); neither traced nor committed."""
        t0 = time.perf_counter()
        self._check_ready()
        toks = self._validate_tokens(tokens)
        if len(toks) > self.context_tier:
            raise self._err(errors.Overflow(
                f"{len(toks)} tokens exceed the context tier of {self.context_tier}", session_id=session_id,
                tokens=len(toks), context_tier=self.context_tier))
        s = self.scoped_session(session_id, cache_salt)
        new_session = s is None
        if s is None:
            s = Session(session_id, root=self.scope_root(cache_salt))
        elif s.busy is not None:
            self._claim(s, "ensure_prefix")  # raises Conflict
        t_look = time.perf_counter()
        plan = self.blocks.plan(s, toks)
        lookup_ms = elapsed_ms(t_look)
        keep = plan.keep
        if s.recompute_from is not None and plan.source != "prefix-cache":
            # held beyond keep: the recomputing decode step's tokens, computed again
            held = common_prefix(s.tokens[: s.kv_len], toks)
            self._counters["decoded_tokens_recomputed_total"] += max(0, held - keep)
        nothing_to_do = keep == len(toks) == len(s.tokens) == s.kv_len
        if plan.need > plan.avail:
            raise self._err(errors.Overflow(
                f"KV memory budget exhausted: need {plan.need} more blocks of {self.kv.block_size} tokens, "
                f"{plan.avail} available ({self.kv.budget_bytes >> 20} MiB budget, {len(self._sessions)} sessions; "
                "blocks live sessions hold are never evicted)", needed_blocks=plan.need, free_blocks=plan.avail,
                budget_bytes=self.kv.budget_bytes))
        if new_session:
            self._sessions[session_id] = s
        self._claim(s, "ensure_prefix")
        self._counters["requests_total"] += 1
        self._counters["prefix_cache_queries"] += len(toks)
        self._counters["prefix_cache_hits"] += keep
        self._counters["prefix_cache_blocks_shared_total"] += len(plan.shared)
        tr_kw: dict[str, Any] = {"prompt_tokens": len(toks), "tokens_reused": keep,
                                 "tokens_computed": len(toks) - keep, "reuse": self._reuse_info(plan, lookup_ms)}
        att: list[dict] = []
        try:
            # every block the plan counted is taken before the first await: a request running meanwhile cannot take
            # them, so no Overflow can come after the session was changed (attach takes them itself)
            if plan.source == "prefix-cache":
                await self.blocks.attach(s, toks, plan)
            elif not nothing_to_do:
                self.blocks.truncate(s, keep)
                self.blocks.grow(s, len(toks))
                if keep < len(toks):
                    await self.blocks.make_writable(s, keep)
            if not nothing_to_do:
                if s.kv_len < len(toks):
                    tr_kw["prefill_ms"], q = await prefill(self, s, toks[s.kv_len :], deadline, att)
                    tr_kw["queue_ms"] = q or 0.0
                tr_kw["fallback"] = self.sparse_policy.fallback(att) if self.sparse else None
        except BaseException:
            # Timeout / cancel: the session holds the chunks computed so far (a prefix of toks); give back the rest
            self.blocks.trim(s)
            if new_session and s.kv_len <= keep:       # nothing computed: a new session is not created after all
                self.kv.free(s.blocks[::-1])
                s.blocks = []
                self._sessions.pop(session_id, None)
            raise
        finally:
            s.busy = None
        return s, t0, tr_kw

    async def prefill_suffix(self, session_id: str, tokens: list[int], deadline: float | None = None) -> Trace:
        """Append ``tokens`` to the session. NotFound if absent; Overflow before any change; on Timeout or
        cancellation the session is rolled back to what it held before."""
        t0 = time.perf_counter()
        self._check_ready()
        toks = self._validate_tokens(tokens)
        s = self._session(session_id)
        if s.busy is not None:
            self._claim(s, "prefill_suffix")
        total = len(s.tokens) + len(toks)
        if total > self.context_tier:
            raise self._err(errors.Overflow(
                f"session holds {len(s.tokens)} tokens; {len(toks)} more exceed the context tier of "
                f"{self.context_tier}", session_id=session_id, session_tokens=len(s.tokens), tokens=len(toks),
                context_tier=self.context_tier))
        at = s.exact_len                # the recomputing step's tokens, if any, are computed again with the append
        self.blocks.fits(self.kv.blocks_for(total) - len(s.blocks) + self.blocks.cow_need(s, at))
        self._claim(s, "prefill_suffix")
        self._counters["requests_total"] += 1
        before = (list(s.tokens), s.kv_len, s.logits, s.recompute_from)
        new = s.tokens[at:] + toks                      # the pending generated token, if any, runs first
        tr_kw: dict[str, Any] = {"prompt_tokens": len(toks), "tokens_computed": len(new)}
        if at < s.kv_len:                               # counted in tokens_computed, as the pending token is
            self._counters["decoded_tokens_recomputed_total"] += s.kv_len - at
            s.kv_len, s.logits, s.recompute_from = at, None, None
        att: list[dict] = []
        try:
            if new:
                self.blocks.grow(s, total)                      # reserved before the first await (ensure_prefix)
                await self.blocks.make_writable(s, s.kv_len)
                tr_kw["prefill_ms"], q = await prefill(self, s, new, deadline, att)
                tr_kw["queue_ms"] = q or 0.0
                tr_kw["fallback"] = self.sparse_policy.fallback(att) if self.sparse else None
        except BaseException:
            # roll back: slots past the old length may hold new K/V but nothing reads them; restore the bookkeeping
            # (slots the recompute rewrote hold a prefill's K/V of the same tokens: still valid, recomputed again)
            s.tokens, s.kv_len, s.logits, s.recompute_from = before
            self.blocks.trim(s)
            raise
        finally:
            s.busy = None
        tr = self._trace(s, t0, **tr_kw)
        self._commit(s)                                  # after the trace: the stored totals count this request
        return tr

    def decode(self, session_id: str, params: SamplingParams, max_tokens: int, stop_token_ids: Sequence[int] = (),
               stop: Sequence[str] = (), deadline: float | None = None,
               ignore_eos: bool = False) -> AsyncIterator[DecodeEvent]:
        """Arguments are validated here (BadRequest / NotFound raised by the call itself); Conflict, Overflow,
        Timeout and Fatal are raised from the iteration. ``ignore_eos``: the model's EOS tokens do not end the output
        (vLLM's name; benchmarks fix the output length with it)."""
        self._check_ready()
        try:
            stop_ids, stops = validate_decode(params, max_tokens, stop_token_ids, stop, self.vocab_size)
        except errors.BadRequest as e:
            raise self._err(e) from None
        self._session(session_id)
        eos = set() if ignore_eos else set(self.tokenizer.eos_token_ids)
        return self._decode_gen(session_id, params, max_tokens, set(stop_ids) | eos, stops, deadline)

    async def _decode_gen(self, session_id: str, params: SamplingParams, max_tokens: int, stop_ids: set[int],
                          stop: list[str], deadline: float | None) -> AsyncIterator[DecodeEvent]:
        t0 = time.perf_counter()
        self._check_ready()
        s = self._session(session_id)
        if s.busy is not None:
            self._claim(s, "decode")
        if not s.tokens:
            # the session's state, not the request, is what refuses it (an EnsurePrefix of no tokens emptied it)
            raise self._err(errors.Conflict(f"session {session_id!r} holds no tokens to continue from",
                                            session_id=session_id))
        granted, clamped = grant(self, s, max_tokens)   # clamped to the context tier, then the KV budget
        self._claim(s, "decode")
        self._counters["requests_total"] += 1
        trace = Trace(session_id=s.id, clamped=clamped)
        gen = None
        if params.temperature > 0:
            gen = torch.Generator().manual_seed(params.seed if params.seed is not None else
                                                int.from_bytes(os.urandom(8), "little") >> 1)
        req = DecodeReq(session=s, params=params, granted=granted, stop_ids=stop_ids, stop=stop, deadline=deadline,
                         gen=gen, trace=trace, t0=t0)
        try:
            if granted > 0 and s.logits is None and s.kv_len == len(s.tokens):
                s.kv_len -= 1                            # logits unknown: re-run the last token first
            self.blocks.grow(s, len(s.tokens) + granted)       # reserve: a running decode never runs out of blocks
            if granted > 0 and s.recompute_from is not None and s.recompute_from < s.kv_len:
                # a decode after a decode whose tokens the recomputing step wrote: those and the pending token get a
                # prefill's K/V and logits first, so what this request decodes does not depend on how the session's
                # earlier output was cut into requests, nor on whether the worker was restarted in between
                t_re = time.perf_counter()
                try:
                    trace.tokens_computed += await self.recompute_decoded(s, pending=True)
                except BaseException:
                    req.done = True                      # never joined the decode loop: nothing to wait for
                    raise
                trace.prefill_ms += round((time.perf_counter() - t_re) * 1e3, 3)
            if granted > 0:                                    # (reserved before this await: ensure_prefix)
                try:
                    await self.blocks.make_writable(s, s.kv_len)
                except BaseException:
                    req.done = True                      # never joined the decode loop: nothing to wait for
                    self.blocks.trim(s)
                    raise
            if granted == 0:
                self.scheduler.finish(req, "length")
            else:
                self.scheduler.submit(req)
            while True:
                ev = await req.queue.get()
                if isinstance(ev, BaseException):
                    raise ev
                if ev.done:
                    self._commit(s)                      # durable before the client reads "done"
                yield ev
                if ev.done:
                    return
        finally:
            if not req.done:
                req.cancelled = True                     # the loop finishes it at its next step boundary
                while not req.finished.is_set():
                    try:
                        await req.finished.wait()
                    except asyncio.CancelledError:
                        continue
            s.busy = None

    # ---- sessions

    async def recompute_decoded(self, s: Session, pending: bool = False) -> int:
        """Give the session's tokens from ``s.recompute_from`` on (the recomputing decode step's) a prefill's K/V
        and logits, on a session the caller has claimed (a snapshot writes only exact K/V). ``pending``: the pending
        token (sampled, not yet in the cache) too, so the next token comes from a prefill's logits (a decode request
        after a decode: what it decodes is then what a session restored from those tokens decodes). Returns how many
        tokens were computed. Interrupted, the session keeps every token, the recomputed prefix exact and the rest
        as the decode step wrote it."""
        at = s.recompute_from
        if at is None or at >= s.kv_len:
            s.recompute_from = None
            return 0
        tokens, kv_len, logits = list(s.tokens), s.kv_len, s.logits
        redo = tokens[at:] if pending else tokens[at:kv_len]
        s.kv_len, s.logits, s.recompute_from = at, None, None
        try:
            await self.blocks.make_writable(s, at)
            await prefill(self, s, redo, None)
        except BaseException:
            done = s.kv_len
            s.tokens, s.kv_len, s.logits = tokens, kv_len, logits
            s.recompute_from = done if done < kv_len else None
            self.blocks.trim(s)
            raise
        s.tokens = tokens                                # the pending token, if any, stays pending unless computed
        self._counters["decoded_tokens_recomputed_total"] += kv_len - at
        return len(redo)

    def close_session(self, session_id: str) -> None:
        s = self._session(session_id)
        if s.busy is not None:
            raise self._err(errors.Conflict(f"session {session_id!r} is busy ({s.busy}); cannot close it now",
                                            session_id=session_id, running=s.busy))
        self.kv.free(s.blocks[::-1])       # full blocks stay cached (evictable, tail first); the rest is free
        s.blocks = []
        del self._sessions[session_id]
        if self.journal is not None:
            self.journal.drop(session_id)

    def _commit(self, s: Session) -> None:
        """The session's state after a completed request, into the session store (journal.py); a store that cannot
        be written is logged and counted (capability ``session_store.errors``), never fails the request."""
        if self.journal is None:
            return
        try:
            self.journal.commit(s.id, list(s.tokens), dict(s.totals), s.root)
        except OSError as e:
            self._journal_errors += 1
            log.warning("session store: could not commit session %r: %s", s.id, e)

    def forget_stored(self, session_id: str) -> bool:
        """Drop the stored state of a session this engine does not hold (closing a session lost with the process);
        False when the engine holds it (close_session closes it) or nothing is stored."""
        return self.journal is not None and session_id not in self._sessions and self.journal.drop(session_id)

    async def recover(self, session_id: str) -> dict[str, Any] | None:
        """A session this engine does not hold, from the session store: its committed tokens prefilled again and
        its totals carried over. None when the engine holds it or nothing is stored; ``{"lost": reason}`` when the
        stored state cannot be used (it stays on disk); else what was restored."""
        if self.journal is None or session_id in self._sessions:
            return None
        d, why = self.journal.read(session_id)
        if d is None:
            return {"lost": why} if why else None
        t0 = time.perf_counter()
        self._sessions[session_id] = Session(session_id, root=bytes.fromhex(d["scope"]))
        try:
            s, t_start, tr_kw = await self._ensure_prefix(session_id, d["tokens"], None, None)
        except BaseException:
            lost = self._sessions.pop(session_id, None)
            if lost is not None and lost.blocks:
                self.kv.free(lost.blocks[::-1])
            raise
        tr = self._trace(s, t_start, **tr_kw)            # the engine's counters count the recompute...
        s.totals = {k: int(d["totals"].get(k, v)) for k, v in s.totals.items()}   # ...the session's totals do not
        # nothing to commit: the store holds exactly these tokens, totals and scope
        return {"tokens_restored": len(d["tokens"]), "tokens_reused": tr.tokens_reused,
                "tokens_computed": tr.tokens_computed, "restore_ms": round(elapsed_ms(t0), 3),
                "committed_at": d.get("committed_at")}

    def sessions(self) -> list[dict]:
        return capability.sessions(self)

    def next_token_logits(self, session_id: str) -> torch.Tensor | None:
        """A copy of the session's next-token logits [V] fp32 (quality checks); None when not known (the last
        generated token has not run through the model yet). NotFound if the session does not exist."""
        s = self._session(session_id)
        return None if s.logits is None or s.kv_len != len(s.tokens) else s.logits.detach().to("cpu", copy=True)

    def session_tokens(self, session_id: str) -> list[int]:
        """The token ids the session holds (a copy). Added to the seam for clients and tests."""
        return list(self._session(session_id).tokens)

    # ---- snapshots (format: docs/reuse.md)

    def _snapshot_identity(self) -> dict[str, Any]:
        """What a snapshot must match to be restored here: the cache identity less the block size (the file holds
        token order, not blocks)."""
        ident = self.reuse_key()
        ident.pop("block_size")
        return ident

    async def snapshot(self, session_id: str, path: str) -> dict:
        """Write the session to ``path`` atomically (snapshot.write_session; format: snapshot.py, docs/reuse.md)."""
        return await snapshot.write_session(self, session_id, path)

    async def restore(self, session_id: str, path: str, cache_salt: str | None = None) -> Trace:
        """Load a snapshot into ``session_id`` (a new session in the cache scope of ``cache_salt``); refusals leave
        the session untouched (snapshot.restore_session)."""
        return await snapshot.restore_session(self, session_id, path, cache_salt)

    # ---- introspection (capability.py)

    def capability(self) -> dict:
        return capability.capability(self)

    def reuse_report(self) -> dict:
        """Prefix reuse as the capability report shows it."""
        return capability.reuse_report(self)

    def reuse_exactness(self) -> str:
        return capability.reuse_exactness(self)

    def metrics(self) -> dict:
        return capability.metrics(self)
