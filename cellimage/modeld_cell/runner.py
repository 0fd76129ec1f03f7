"""The model runner of the torch backend: builds the attention metadata for a forward, owns the decode-kernel
choice as instance state, and calls the model (vLLM's model runner, in small). One runner per engine; a CUDA / Triton
backend is another runner with the same three methods, not branches inside the engine. ``TorchThread`` is the one
thread every forward runs on.

    prefill(tokens, start, blocks, sparse) -> (logits [V] fp32 on the device, t_start, sparse_log)
    decode(toks, positions, tables)        -> logits [B, V] fp32 on the device
    choose_decode_kernel(mode)             -> validates kernels.dispatch and records what decode runs
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from . import errors
from .kv_cache import PagedKVCache
from .model import AttnMetadata, Transformer


class TorchThread:
    """The ONE thread torch work runs on (forward passes never overlap; the event loop stays free). Its intra-op
    pool is sized there (OpenMP thread counts are per calling thread)."""

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-torch",
                                            initializer=torch.set_num_threads, initargs=(threads,))

    async def run(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, bool]:
        """Run fn on the thread. Returns (result, cancelled). The job cannot be interrupted once started, so a
        cancellation waits for it and is reported as ``cancelled=True``: the caller records what the job wrote,
        then raises CancelledError itself. The job's own exception propagates."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        cancelled = False
        while True:
            try:
                return await asyncio.shield(fut), cancelled
            except asyncio.CancelledError:
                if fut.cancelled():  # never started (executor shut down)
                    raise
                cancelled = True

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the thread, from outside an event loop (start-up): waits for it."""
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def contig_start(blocks: Sequence[int], nblk: int) -> int | None:
    """First block id when blocks[:nblk] are consecutive ids (attention can use a zero-copy view), else None."""
    if nblk == 0:
        return None
    b0 = blocks[0]
    for i in range(1, nblk):
        if blocks[i] != b0 + i:
            return None
    return b0


@contextlib.contextmanager
def _intra_op(threads: int, restore: int) -> Iterator[None]:
    """The start-up measurements' variant context: ``threads`` intra-op threads, ``restore`` after."""
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(restore)


class TorchRunner:
    name = "torch"

    def __init__(self, model: Transformer, kv: PagedKVCache) -> None:
        self.model, self.kv = model, kv
        self.decode_kernel = "torch-reference"          # what decode runs, in words (the capability report)
        self._decode_fn: Callable[..., Tensor] | None = None   # a validated dispatch.paged_decode, or None
        self._quant_dispatch = False                    # quantized decode through dispatch.quant_paged_decode on CPU
        self.decode_threads: int | None = None          # intra-op threads of a one-session decode (None: the process's)
        # a one-session step with at least this many tokens already cached runs at the process count even where
        # decode_threads is one (choose_decode_threads: attention grows with the context); None: never
        self.decode_wide_from: int | None = None
        self.decode_threads_report: dict[str, Any] | None = None
        self.decode_step: Any = None                    # a validated decode_step.ScriptedDecode, or None: eager
        self.decode_step_report: dict[str, Any] | None = None
        # "recompute": a one-session step runs ``recompute_step`` (decode_step.py, exact=False), whose K/V are not a
        # prefill's bits, and the engine computes those tokens again before any prefill after them (Session.
        # recompute_from); "exact": every decoded token's K/V are the bits a prefill of it computes
        self.decoded_kv = "exact"
        self.recompute_step: Any = None
        self.decoded_kv_report: dict[str, Any] | None = None
        # prefill chunks and exact decode rows attend through cpu.c's row attention (choose_row_attention chose it
        # for the model; it serves an unquantized bf16/fp32 pool): its name, part of the cache identity, else None
        self.rows_attention: str | None = rows_attention_serves(model, kv)

    # the backend's attention for every forward (AttnMetadata.attend); None: model.py's torch paths
    attend: Callable[..., Tensor] | None = None

    @property
    def chunking_invariant(self) -> bool:
        """Rows get the same bits however a sequence is chunked (the CPU torch path; model.chunking_invariant)."""
        from .model import chunking_invariant
        return chunking_invariant(self.kv.k.device)

    # the recomputing steps _recompute_kernel builds, by the name choose_decoded_kv's report gives the one served
    RECOMPUTE_STEPS = {
        "flash": "the scripted step, its attention torch's flash call",
        "kernel": "the scripted step, its attention cpu.c's paged decode",
        "layers": "every layer in one cpu.c call (decode_step.KernelDecode), over the dense weights",
        "layers-q4": "every layer in one cpu.c call (decode_step.KernelDecode), its linears read from the file's Q4_1 "
                     "blocks"}

    def kernels(self) -> dict[str, str]:
        """What each kind of forward runs, in words (the capability report)."""
        dev = self.kv.k.device
        if self.rows_attention:
            prefill = f"{self.rows_attention}: each row on its own (CPU; chunking-invariant)"
        else:
            prefill = (("torch segmented flash (CPU; chunking-invariant)" if self.chunking_invariant else "torch sdpa")
                       + ("; past blocks dequantized per chunk" if self.kv.fmt.quantized else ""))
        return {"prefill": prefill, "decode": self.decode_words(), "device": str(dev)}

    def decode_words(self) -> str:
        """What a decode step runs, in words: the exact step's attention (``decode_kernel``), and, where
        choose_decoded_kv took the recomputing step, that one-session steps run it instead."""
        if self.decoded_kv != "recompute" or self.recompute_step is None:
            return self.decode_kernel
        served = ((self.decoded_kv_report or {}).get("attention") or {}).get("served", "flash")
        what = self.RECOMPUTE_STEPS.get(served, served)
        if served == "layers-q4" and getattr(self.recompute_step, "head_blocks", None) is not None:
            what += " and its head from the file's Q8_0 blocks"
        return (f"one-session steps: the recomputing step '{served}' ({what}; a prefill computes its tokens' K/V "
                f"again before anything reuses them); batched steps: {self.decode_kernel}")

    def choose_decode_kernel(self, mode: str) -> None:
        """Validate kernels.dispatch.paged_decode against model.py's torch path; route decode through it when
        ``mode`` (MODELD_DECODE_ATTENTION) says so ("dispatch"), or by default ("auto") on CUDA. On CPU "auto" keeps model.py's
        segmented torch path, the one prefill uses: a decoded token's K/V are then the bits a later prefill of the
        same tokens computes (exact reuse; docs/reuse.md), which no separate decode kernel promises."""
        from .model import paged_attention
        self._decode_fn, self._quant_dispatch = None, False
        if self.kv.fmt.quantized:
            from .kernels import dispatch
            if self.kv.k.device.type == "cpu" and mode != "dispatch":
                self.decode_kernel = (f"torch segmented (model._segmented_attention over the dequantized "
                                      f"{self.kv.fmt.quant} cache; chunking-invariant)")
                return
            self._quant_dispatch = True
            self.decode_kernel = (f"kernels.dispatch.quant_paged_decode ({self.kv.fmt.quant}, "
                                  f"{dispatch.get_backend(self.kv.k.device)})")
            return
        try:
            from .kernels import dispatch

            def fn(q, kc, vc, bt, sl, scale):  # noqa: ANN001, ANN202  (the seam's signature)
                return dispatch.paged_decode(q, kc, vc, bt, sl, sm_scale=scale, check_tables=False)

            g = torch.Generator().manual_seed(0)
            a = self.model.args
            hkv, d, bs = a.n_kv_heads, a.head_dim, self.kv.block_size
            dev = self.kv.k.device
            kc = torch.randn(6, bs, hkv, d, generator=g).to(device=dev, dtype=self.kv.fmt.storage)
            vc = torch.randn(6, bs, hkv, d, generator=g).to(device=dev, dtype=self.kv.fmt.storage)
            q = torch.randn(2, a.n_heads, d, generator=g).to(device=dev, dtype=self.model.compute_dtype)
            bt = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32, device=dev)
            sl = torch.tensor([37, 17], dtype=torch.int32, device=dev)
            meta = AttnMetadata("decode", torch.zeros(2, dtype=torch.long), bt, sl, [37, 17], bs, [None, None])
            ref = paged_attention(q, kc[0, :2], vc[0, :2], kc, vc, meta)
            out = fn(q, kc, vc, bt, sl, 1.0 / math.sqrt(d))
            tol = 1e-4 if q.dtype == torch.float32 else 2e-2
            err = float((out.float() - ref.float()).abs().max())
            if not err <= tol:
                raise ValueError(f"disagrees with the torch path: max abs diff {err:.3g} > {tol}")
        except Exception as e:  # absent, or broken: the torch path in model.py serves
            self.decode_kernel = f"torch (model.paged_attention); kernels.dispatch unusable: {type(e).__name__}: {e}"
            if mode == "dispatch":
                raise errors.Fatal(f"MODELD_DECODE_ATTENTION=dispatch but {self.decode_kernel}") from e
            return
        if mode == "dispatch" or (mode == "auto" and dev.type == "cuda"):
            self._decode_fn = fn
            self.decode_kernel = f"kernels.dispatch.paged_decode ({dispatch.get_backend(dev)}; validated)"
        elif self.rows_attention:   # model.paged_attention: a decode row attends as a prefill's row does
            self.decode_kernel = (f"{self.rows_attention}: the row a prefill computes (CPU; chunking-invariant); "
                                  "kernels.dispatch.paged_decode validated but not used on CPU")
        else:
            self.decode_kernel = ("torch segmented (model._segmented_attention; chunking-invariant); "
                                  "kernels.dispatch.paged_decode validated but not used on CPU")

    @torch.no_grad()
    def choose_decode_threads(self, setting: int | None, reps: int = 7, context: int = 64) -> dict[str, Any]:
        """How many intra-op threads a one-session decode step runs with (call on the torch thread). A decode step
        is some 3,000 small ops: on a 2-core VM, waking the second OpenMP thread for each cost more than it gave
        (measured: 68-86 ms a step on one thread against 97-126 ms on two after 1k tokens; even at 4k).
        ``setting`` (MODELD_DECODE_THREADS) fixes it; None measures it here, on the loaded model: one session of
        ``context`` tokens in scratch blocks, its next token decoded ``reps`` times at each count alternately (the
        same position, so the same bits every time), and the faster median wins by 10 %. A count whose logits
        differ in a single bit from the process count's is never taken (prefill runs at the process count, and exact
        reuse needs decode == prefill). Batched decode steps keep the process count. Where one thread is taken,
        choose_decode_wide measures longer contexts after the step is chosen."""
        n = torch.get_num_threads()
        self.decode_threads, self.decode_wide_from = None, None
        if hasattr(self.model, "head_threads"):
            self.model.head_threads = None
        rep: dict[str, Any] = {"threads": n, "process_threads": n}
        if setting is not None:
            self.decode_threads = setting if setting != n else None
            rep.update(threads=setting, reason="MODELD_DECODE_THREADS")
        elif n == 1 or self.kv.k.device.type != "cpu":
            rep["reason"] = "one intra-op thread" if n == 1 else "not the CPU"
        elif self.kv.free_blocks < self.kv.blocks_for(context + 1):
            rep["reason"] = "not measured: no free KV blocks"
        else:
            rep.update(self._measure_decode_threads(n, reps, context))
        self.decode_threads_report = rep
        return rep

    def choose_decode_wide(self, context_limit: int | None = None, reps: int = 7) -> dict[str, Any] | None:
        """Where choose_decode_threads' measurement took one thread: the context length from which a one-session
        step runs at the process count again (``decode_wide_from``; _measure_wide_from), measured up to
        ``context_limit`` (the cell's tier). Call on the torch thread after choose_decode_step, so that the step
        timed is the step served (the scripted step gains more from a second thread than the eager one, whose
        Python runs on one). The figures go into decode_threads_report["wide"]; None where nothing was measured (a
        count MODELD_DECODE_THREADS fixed holds at every length)."""
        self.decode_wide_from = None
        rep = self.decode_threads_report
        if rep is None or self.decode_threads != 1 or rep.get("reason") == "MODELD_DECODE_THREADS":
            return None
        rep["wide"] = self._measure_wide_from(rep["process_threads"], reps, context_limit)
        return rep["wide"]

    # contexts (tokens in the cache) a one-session step is timed at, beyond the short one, when the short one takes
    # one thread: its attention grows with the context (flash over every 512-key segment), and at some length the
    # process count pays for its wake-ups
    WIDE_CONTEXTS = (1024, 2048, 4096, 8192)

    def _measure_wide_from(self, n: int, reps: int, context_limit: int | None) -> dict[str, Any]:
        """The context from which a one-session step runs at the process count although the short context's
        measurement took one thread (``decode_wide_from``). At each of WIDE_CONTEXTS the cell can hold (the tier's
        last position in place of any beyond it), longest first, the same token is decoded ``reps`` times
        alternately as the short measurement chose (one thread, the head as it chose) and at the process count,
        over scratch blocks filled with seeded random K/V (no prefill: a step's time does not depend on the values);
        the process count wins a context by 10 % with logits and K/V equal bit for bit, and the search stops at the
        first context it does not win. Same bits are required because a session's steps then run at either count by
        its length."""
        rep: dict[str, Any] = {"from": None, "median_ms": {}, "bitwise_equal": True}
        head = getattr(self.model, "head_threads", None)
        if self.kv.fmt.quantized:
            rep["reason"] = "not measured: a quantized KV cache (its scratch blocks need valid scales)"
            return rep
        limit = min(self.model.args.max_seq_len, context_limit or self.model.args.max_seq_len)
        ctxs = sorted({min(c, limit - 1) for c in self.WIDE_CONTEXTS})          # the tier's last position at most
        ctxs = [c for c in ctxs if c >= self.WIDE_CONTEXTS[0] and self.kv.free_blocks >= self.kv.blocks_for(c + 1)]
        if not ctxs:
            rep["reason"] = "not measured: the cell holds no context of " + str(self.WIDE_CONTEXTS[0]) + " tokens"
            return rep

        one = "1" if head is None else f"1, head at {head}"      # the head as the short measurement chose
        lost = None
        was, self.decode_threads = self.decode_threads, None      # decode() then keeps the variant's count
        try:
            for c in sorted(ctxs, reverse=True):
                variants = {one: lambda: _intra_op(1, n), str(n): lambda: _intra_op(n, n)}
                ms, same = self._decode_alternately(variants, reps, c, seed=29, with_kv=True, prefill=False)
                rep["median_ms"][str(c)] = ms
                rep["bitwise_equal"] = rep["bitwise_equal"] and same
                if not (same and ms[str(n)] < 0.9 * ms[one]):
                    lost = c
                    break
                rep["from"] = c
        finally:
            self.decode_threads = was
        if not rep["bitwise_equal"]:
            rep["from"] = None
        self.decode_wide_from = rep["from"]
        if not rep["bitwise_equal"]:
            rep["reason"] = f"{n} threads' logits or K/V differ from one thread's at a long context: not taken"
        elif rep["from"] is None:
            rep["reason"] = f"{n} threads are not 10 % faster than one at {lost} tokens: one thread at every length"
        else:
            rep["reason"] = (f"a one-session step with {rep['from']} tokens or more cached runs at {n} threads: 10 % "
                             f"faster there and at every longer context measured, with the same bits"
                             + (f" (not at {lost})" if lost else ""))
        return rep

    def _measure_decode_threads(self, n: int, reps: int, context: int) -> dict[str, Any]:
        """choose_decode_threads' measurement: the step at the process count, at one thread, and (a model with
        ``logits``' head_threads) at one thread with the head at the process count; the faster one-thread variant
        is taken when it beats the process count by 10 % with the same bits."""
        split = hasattr(self.model, "head_threads")
        head_n = f"1, head at {n}"

        @contextlib.contextmanager
        def threads(th: int, head: int | None = None) -> Iterator[None]:
            if split:
                self.model.head_threads = head
            try:
                with _intra_op(th, n):
                    yield
            finally:
                if split:
                    self.model.head_threads = None

        variants: dict[str, Callable[[], AbstractContextManager[Any]]] = {str(n): lambda: threads(n),
                                                                          "1": lambda: threads(1)}
        if split:
            variants[head_n] = lambda: threads(1, n)
        ms, same = self._decode_alternately(variants, reps, context, seed=0, with_kv=False)
        one = min((k for k in ms if k != str(n)), key=lambda k: ms[k])
        faster = ms[one] < 0.9 * ms[str(n)]
        if faster and same:
            self.decode_threads = 1
            if one == head_n:
                self.model.head_threads = n
        reason = (("one thread decodes faster here" + (f", with the head at {n}" if one == head_n else ""))
                  if faster and same else
                  "one thread decodes faster, but its logits differ from the process count's: not taken" if faster
                  else f"{n} threads decode as fast or faster here")
        return {"threads": self.decode_threads or n, "head_threads": getattr(self.model, "head_threads", None),
                "median_ms": ms, "bitwise_equal": same, "context": context, "reps": reps, "reason": reason}

    def _decode_alternately(self, variants: dict[str, Callable[[], AbstractContextManager[Any]]], reps: int,
                            context: int, seed: int, with_kv: bool, gap: float = 0.005,
                            prefill: bool = True, seen: dict[str, Any] | None = None) -> tuple[dict[str, float], bool]:
        """The start-up measurements' scaffold: one session of ``context`` tokens (a fixed pseudo-random sequence,
        offset by ``seed``) prefilled into scratch blocks, then its next token decoded ``reps`` times under each
        variant in turn (``variants[name]()`` is the context the step runs in), ``gap`` seconds apart as served steps
        are (the scheduler's turn, sampling, the reply). The same position every time, so the same bits are
        expected: returns each variant's median ms (the first round dropped as warm-up) and whether every step's
        logits, and with ``with_kv`` the K/V every layer wrote for the token, equal the first step's bit for bit.
        ``prefill=False``: the scratch blocks hold seeded random K/V instead of a prefill's (an unquantized cache;
        for timing long contexts without prefilling them). ``seen``, when given, receives the prefill's seconds
        (``prefill_s``) and each variant's last logits (``logits``)."""
        blocks = self.kv.allocate(self.kv.blocks_for(context + 1))
        times: dict[str, list[float]] = {k: [] for k in variants}
        first: tuple[Tensor, ...] | None = None
        same = True
        bs = self.kv.block_size
        slot = blocks[context // bs] * bs + context % bs
        try:
            toks = [(i * 7919 + seed) % self.model.args.vocab_size for i in range(context + 1)]
            if prefill:
                t0 = time.perf_counter()
                self.prefill(toks[:context], 0, blocks)
                if seen is not None:
                    seen["prefill_s"] = time.perf_counter() - t0
            else:
                g = torch.Generator().manual_seed(seed)
                idx = torch.tensor(blocks, dtype=torch.long, device=self.kv.k.device)
                for c in (self.kv.k, self.kv.v):
                    for layer in range(c.shape[0]):       # a layer at a time: no whole-pool fp32 temporary
                        c[layer].index_copy_(0, idx, torch.randn(len(blocks), *c.shape[2:], generator=g).to(
                            device=c.device, dtype=c.dtype))
            for _ in range(reps):
                for name, enter in variants.items():
                    time.sleep(gap)
                    with enter():
                        t0 = time.perf_counter()
                        logits = self.decode([toks[context]], [context], [blocks])
                        times[name].append((time.perf_counter() - t0) * 1e3)
                    if seen is not None:
                        seen.setdefault("logits", {})[name] = logits
                    got: tuple[Tensor, ...] = (logits,)
                    if with_kv:
                        got += tuple(c.view(c.shape[0], -1, *c.shape[3:])[:, slot].clone()
                                     for c in (self.kv.k, self.kv.v))
                    if first is None:
                        first = got
                    else:
                        same = same and all(torch.equal(x, y) for x, y in zip(first, got, strict=True))
        finally:
            self.kv.free(blocks[::-1])
        return {k: round(statistics.median(v[1:] or v), 2) for k, v in times.items()}, same

    def _unscriptable(self) -> str | None:
        """None when a one-session step of this runner can run as decode_step.py's scripted graph (either step),
        else why not."""
        from . import decode_step
        if type(self).forward is not TorchRunner.forward or self.attend is not None or self._decode_fn is not None:
            return f"the {self.name} runner's decode is not model.py's torch path"
        return decode_step.eligible(self.model, self.kv)

    @torch.no_grad()
    def choose_decode_step(self, setting: str = "auto", reps: int = 5, context: int = 64,
                           measured_by: str | None = None) -> dict[str, Any]:
        """Whether a one-session decode step runs as one TorchScript graph (decode_step.py) or eagerly (call on the
        torch thread, after choose_decode_threads). ``setting`` (MODELD_DECODE_STEP): "eager" never scripts;
        "script" takes it untimed wherever this cell can serve it (errors.Fatal when it fails to compile or its bits
        differ; a cell it cannot serve, such as a quantized KV cache, decodes eagerly, saying why); "auto" measures
        here, on the loaded model: one session of ``context`` tokens in scratch blocks, its next token decoded ``reps`` times each
        way alternately. The scripted step is taken only when its logits and every layer's K/V for the token equal
        the eager step's bit for bit (exact reuse needs decode == prefill), and under "auto" only when its median is
        the lower. ``measured_by``: another engine over the same weights measured it faster (Engine.sibling); this
        runner's pool then checks its own bits once and never raises."""
        from . import decode_step
        self.decode_step = None
        rep: dict[str, Any] = {"step": "eager", "setting": setting}
        why = "MODELD_DECODE_STEP=eager" if setting == "eager" else self._unscriptable()
        if why is None and self.kv.free_blocks < self.kv.blocks_for(context + 1):
            why = "not measured: no free KV blocks"
        step = None
        servable = why is None                  # "script" stops the worker only for a step this cell could serve
        if why is None:
            try:
                # the exact step attends as a prefill does: through the row attention where it serves
                step = decode_step.ScriptedDecode(self.model, self.kv, kernel=self.rows_attention is not None)
            except Exception as e:      # TorchScript absent or unable to compile this torch's ops
                why = f"torch.jit.script failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        if step is not None:
            rep.update(self._measure_decode_step(step, reps, context))
            if not rep["bitwise_equal"]:
                why = "the scripted step's bits differ from the eager step's: not taken"
            elif setting == "auto" and measured_by is None and rep["median_ms"]["script"] >= rep["median_ms"]["eager"]:
                why = "the eager step is as fast or faster here"
        if why is None:
            self.decode_step = step
            rep.update(step="torchscript", reason="the scripted step has the eager bits" + (
                f" and {measured_by} measured it faster" if measured_by else
                " and is faster here" if setting == "auto" else " (MODELD_DECODE_STEP=script)"))
        else:
            rep["reason"] = why
        self.decode_step_report = rep
        if why is not None and servable and setting == "script" and measured_by is None:
            raise errors.Fatal(f"MODELD_DECODE_STEP=script, but {why}")
        return rep

    # the largest next-token KL divergence of the recomputing step's logits from the exact step's that
    # choose_decoded_kv accepts: the q4_1 weights' quality smoke's bound on a whole-model change (quality.py), so
    # a step that computes another function, not the same one rounded otherwise, is never served
    RECOMPUTE_KL_MAX = 0.05

    # the cached tokens at which choose_decoded_kv times the recomputing step's two attentions against each other: at
    # 512 they took 39.77 and 40.44 ms a step on the EPYC (within its noise), one layer's attention 97 against 284 us
    # at 1k keys and 355 against 1,150 at 4k (docs/kernels.md): the choice is made where attention weighs
    ATTENTION_CONTEXT = 4096

    @torch.no_grad()
    def choose_decoded_kv(self, setting: str = "auto", reps: int = 7, context: int = 512, kernels: str = "auto",
                          cache_dir: str | None = None) -> dict[str, Any]:
        """Whether a one-session decode step writes exact K/V or runs the recomputing step (call on the torch
        thread, after choose_decode_step and before choose_decode_wide, which then times the step served).

        The exact step (model.segmented_row's 512-key segments and LSE merge, a dense row multiplied as two) gives a
        decoded token the K/V bits a prefill of it computes, which bitwise reuse of a session's replies rests on.
        The recomputing step (decode_step.py, exact=False: one attention over every key, a row multiplied alone)
        does less work for other roundings; the engine then computes the tokens it decoded again, with the prefill,
        before anything is appended after them (or a snapshot is written), so every K/V a later request reuses is
        still a prefill's. ``setting`` (MODELD_DECODED_KV): "exact" never recomputes; "recompute" takes it wherever
        the scripted step can serve the cell; "auto" measures here: one session of ``context`` tokens prefilled into
        scratch blocks (timed: what recomputing a token costs), its next token decoded ``reps`` times each way
        alternately. Taken when the recomputing step's median saves more than a prefilled token costs (each token
        it decodes is computed again later) and its next-token KL divergence from the exact step's logits is at
        most RECOMPUTE_KL_MAX.

        The recomputing step's attention is torch's flash call, or the CPU paged-decode kernel
        (kernels/paged_decode/cpu.c, built at start into ``cache_dir``) where ``kernels`` (MODELD_CPU_KERNELS)
        allows: "auto" builds it where a C compiler is present and serves it when its step is faster than the flash
        call's at ATTENTION_CONTEXT cached tokens (``_choose_attention``); "on" serves it untimed and is fatal where
        it cannot load; "off" never builds it."""
        from . import decode_step
        self.decoded_kv, self.recompute_step = "exact", None
        rep: dict[str, Any] = {"decoded_kv": "exact", "setting": setting}
        why = "MODELD_DECODED_KV=exact" if setting == "exact" else self._unscriptable()
        step = None
        if why is None:
            try:
                step = decode_step.ScriptedDecode(self.model, self.kv, exact=False)
            except Exception as e:      # TorchScript absent or unable to compile this torch's ops
                why = f"torch.jit.script failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        if why is None:
            rep["attention"], ksteps = self._recompute_kernel(kernels, cache_dir, step)
            if ksteps:
                step = self._choose_attention(rep["attention"], step, ksteps, kernels, reps)
        if why is None and setting == "auto":
            context = min(context, self.model.args.max_seq_len - 1)
            if self.kv.free_blocks < self.kv.blocks_for(context + 1):
                why = "not measured: no free KV blocks"
            else:
                rep.update(self._measure_recompute(step, reps, context))
                if rep["kl"] > self.RECOMPUTE_KL_MAX:
                    why = (f"the recomputing step's logits are {rep['kl']} (KL) from the exact step's, over "
                           f"{self.RECOMPUTE_KL_MAX}: not taken")
                elif rep["saved_ms"] <= rep["prefill_ms_per_token"]:
                    why = (f"the recomputing step saves {rep['saved_ms']} ms a token, not more than recomputing it "
                           f"costs ({rep['prefill_ms_per_token']} ms a prefilled token)")
        if why is None:
            self.decoded_kv, self.recompute_step = "recompute", step
            rep.update(decoded_kv="recompute", reason=(
                "MODELD_DECODED_KV=recompute" if setting == "recompute" else
                f"the recomputing step saves {rep['saved_ms']} ms a token, more than recomputing it costs "
                f"({rep['prefill_ms_per_token']} ms)"))
        else:
            rep["reason"] = why
        if getattr(self.model, "decode_blocks", None) is not None and not getattr(self.model, "blocks_settled", False):
            # the Q4_1 blocks stay only where their step serves: the loader built them for the first engine's choice
            # (a sibling engine over the same weights takes them where they are kept, and leaves them be)
            self.model.decode_blocks = getattr(self.recompute_step, "blocks", None)
            self.model.decode_head_blocks = getattr(self.recompute_step, "head_blocks", None)
            self.model.blocks_settled = True
        self.decoded_kv_report = rep
        return rep

    def _recompute_kernel(self, kernels: str, cache_dir: str | None, flash: Any) -> tuple[dict[str, Any],
                                                                                         dict[str, Any]]:
        """choose_decoded_kv's kernel half: loads the CPU kernels (kernels/paged_decode/cpu.c) unless ``kernels``
        is "off", and builds the recomputing steps that call them: "kernel", the scripted step with its attention
        by the paged-decode kernel, and "layers", every layer of the row in one C call (decode_step.KernelDecode,
        where the weights are plain dense ones: loader.keep_plain_for_kernels keeps them so where measured faster),
        its linears split over the process's threads. Returns the report's ``attention`` entry and those steps by
        name (none where there are none, and the entry says why)."""
        from . import decode_step
        from .kernels.paged_decode import cpu as cpu_attention
        if kernels == "off":
            return {"served": "flash", "reason": "MODELD_CPU_KERNELS=off"}, {}
        build = cpu_attention.load(cache_dir)
        why = build["reason"] if not build["loaded"] else decode_step.kernel_eligible(flash.model, flash.kv)
        att: dict[str, Any] = {"served": "flash", "build": build}
        steps: dict[str, Any] = {}
        if why is None:
            try:
                steps["kernel"] = decode_step.ScriptedDecode(flash.model, flash.kv, exact=False, kernel=True)
            except Exception as e:
                why = f"torch.jit.script failed with the kernel: {type(e).__name__}: {str(e)[:200]}"
        if why is None:
            layers_why = decode_step.layers_eligible(flash.model, flash.kv)
            if layers_why is None:
                steps["layers"] = decode_step.KernelDecode(flash.model, flash.kv, torch.get_num_threads())
            else:
                att["layers"] = layers_why
            blocks = getattr(flash.model, "decode_blocks", None)
            if blocks is not None:
                q4_why = decode_step.layers_eligible(flash.model, flash.kv, blocks)
                if q4_why is None:
                    steps["layers-q4"] = decode_step.KernelDecode(
                        flash.model, flash.kv, torch.get_num_threads(), blocks,
                        getattr(flash.model, "decode_head_blocks", None))
                else:
                    att["layers-q4"] = q4_why
            return att, steps
        if kernels == "on":
            raise errors.Fatal(f"MODELD_CPU_KERNELS=on, but {why}")
        att["reason"] = why
        return att, {}

    def _choose_attention(self, att: dict[str, Any], flash: Any, steps: dict[str, Any], kernels: str,
                          reps: int) -> Any:
        """The recomputing step to serve: the flash call's, or one of ``steps`` (``_recompute_kernel``'s). Untimed
        under MODELD_CPU_KERNELS=on (the whole-layer step where there is one), else the fastest at
        ATTENTION_CONTEXT cached tokens (the tier's last position where it is shorter), the same token decoded
        ``reps`` times each way alternately over scratch blocks of seeded random K/V. Records the figures and why
        in ``att``."""
        if kernels == "on":
            name = next(k for k in ("layers-q4", "layers", "kernel") if k in steps)
            att.update(served=name, reason="MODELD_CPU_KERNELS=on")
            return steps[name]
        n = min(self.ATTENTION_CONTEXT, self.model.args.max_seq_len - 1)
        if self.kv.free_blocks < self.kv.blocks_for(n + 1):
            att["reason"] = f"not measured: no free KV blocks for {n} tokens"
            return flash
        variants = {"flash": flash, **steps}
        ms, _ = self._decode_alternately({k: functools.partial(self._serving, "recompute", v)
                                          for k, v in variants.items()},
                                         reps, n, seed=19, with_kv=False, prefill=False)
        best = min(ms, key=lambda k: ms[k])
        others = ", ".join(f"{k} {v} ms" for k, v in ms.items() if k != best)
        att.update(median_ms=ms, context=n, reps=reps, served=best,
                   reason=f"after {n} tokens the {best} step took {ms[best]} ms ({others})")
        return variants[best]

    @contextlib.contextmanager
    def _serving(self, kind: str, step: Any) -> Iterator[None]:
        """A start-up measurement's variant: one-session steps decode as ``kind`` ("exact", or "recompute" through
        ``step``) inside, exact after."""
        self.decoded_kv, self.recompute_step = kind, step
        try:
            yield
        finally:
            self.decoded_kv, self.recompute_step = "exact", None

    def _measure_recompute(self, step: Any, reps: int, context: int) -> dict[str, Any]:
        """choose_decoded_kv's measurement: the exact step served now (scripted or eager) against ``step``."""
        seen: dict[str, Any] = {}
        ms, _ = self._decode_alternately({"exact": lambda: self._serving("exact", step),
                                          "recompute": lambda: self._serving("recompute", step)},
                                         reps, context, seed=17, with_kv=False, seen=seen)
        ref = torch.log_softmax(seen["logits"]["exact"].float().reshape(-1), -1)
        got = torch.log_softmax(seen["logits"]["recompute"].float().reshape(-1), -1)
        kl = float((ref.exp() * (ref - got)).sum())
        return {"median_ms": ms, "context": context, "reps": reps, "kl": round(max(kl, 0.0), 6),
                "saved_ms": round(ms["exact"] - ms["recompute"], 2),
                "prefill_ms_per_token": round(seen["prefill_s"] * 1e3 / context, 3),
                "threads": self.decode_threads or torch.get_num_threads()}

    def _measure_decode_step(self, step: Any, reps: int, context: int) -> dict[str, Any]:
        @contextlib.contextmanager
        def stepping(s: Any) -> Iterator[None]:
            self.decode_step = s
            try:
                yield
            finally:
                self.decode_step = None

        ms, same = self._decode_alternately({"eager": lambda: stepping(None), "script": lambda: stepping(step)},
                                            reps, context, seed=13, with_kv=True)
        return {"median_ms": ms, "bitwise_equal": same, "context": context, "reps": reps,
                "threads": self.decode_threads or torch.get_num_threads()}

    def forward(self, tokens: Tensor, positions: Tensor, meta: AttnMetadata, rows: Tensor | None = None) -> Tensor:
        """One forward of the model over this runner's pool: fp32 logits [len(rows) or N, V] (a pipeline stage runs
        its part of it instead: parallel/pipeline.py)."""
        return self.model(tokens, positions, self.kv, meta, rows)

    def prefill(self, tokens: list[int], start: int, blocks: list[int],
                sparse: dict | None = None) -> tuple[Tensor, float, list[dict]]:
        """tokens at positions [start, start+T) of a session with block table ``blocks``, block-sparse with the
        settings ``sparse`` (None: dense). Returns (logits [V] fp32 on the device, start time, per-layer sparse log)."""
        t_start = time.perf_counter()
        dev = self.kv.k.device
        end = start + len(tokens)
        nblk = self.kv.blocks_for(end)
        meta = AttnMetadata(
            kind="prefill", slot_mapping=self.kv.slots(blocks, start, end).to(dev),
            block_tables=torch.tensor([blocks[:nblk]], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev), seq_lens_list=[end],
            block_size=self.kv.block_size, contiguous=[contig_start(blocks, nblk)], attend=self.attend,
            rows_attention=self.rows_attention is not None)
        meta.sparse = sparse
        toks = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.arange(start, end, device=dev)
        logits = self.forward(toks, pos, meta, torch.tensor([len(tokens) - 1], device=dev))
        return logits[0], t_start, meta.sparse_log     # on the device: sampling reads only the ids back

    def writes_exact(self, sessions: int) -> bool:
        """Whether a decode step of ``sessions`` sessions writes the K/V bits a prefill computes (False: the
        recomputing step, ``decoded_kv`` "recompute", which serves one-session steps only)."""
        return not (sessions == 1 and self.decoded_kv == "recompute" and self.recompute_step is not None)

    def decode(self, toks: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        """One token per session: toks[b] at positions[b]. Returns logits [B, V] fp32 on the device. One session
        runs at ``decode_threads`` and, when one was taken, through the scripted step (which builds its own tables)."""
        if len(toks) > 1:
            return self._decode_forward(toks, positions, tables)
        step = self.decode_step if self.writes_exact(1) else self.recompute_step
        n = torch.get_num_threads()
        threads = self.decode_threads
        if self.decode_wide_from is not None and positions[0] >= self.decode_wide_from:
            threads = None                   # a long context: the process count (choose_decode_threads' "wide")
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            return step(toks[0], positions[0], tables[0]) if step is not None else \
                self._decode_forward(toks, positions, tables)
        finally:
            torch.set_num_threads(n)

    def _decode_forward(self, toks: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        """The eager decode forward: the batch's decode AttnMetadata, then model.py's forward."""
        dev = self.kv.k.device
        seq = [p + 1 for p in positions]
        nblks = [self.kv.blocks_for(s) for s in seq]
        width = max(nblks)
        bt = torch.zeros(len(toks), width, dtype=torch.int32)
        for b, t in enumerate(tables):
            bt[b, : nblks[b]] = torch.tensor(t[: nblks[b]], dtype=torch.int32)
        bs = self.kv.block_size
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for b, p in enumerate(positions)], dtype=torch.long)
        meta = AttnMetadata(kind="decode", slot_mapping=slots.to(dev), block_tables=bt.to(dev),
                            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev), seq_lens_list=seq,
                            block_size=bs, contiguous=[contig_start(t, n) for t, n in zip(tables, nblks, strict=True)],
                            decode_kernel=self._decode_fn, quant_decode_dispatch=self._quant_dispatch,
                            attend=self.attend, rows_attention=self.rows_attention is not None)
        return self.forward(torch.tensor(toks, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), meta)


def rows_attention_serves(model: Transformer, kv: PagedKVCache) -> str | None:
    """The row attention's name where ``model`` took it (choose_row_attention) and ``kv`` is a pool it reads (an
    unquantized bf16/fp32 cache on the CPU), else None."""
    from .kernels.paged_decode import cpu as cpu_kernels_mod

    name = getattr(model, "row_attention", None)
    if name is None or kv.fmt.quantized or kv.k.device.type != "cpu" or kv.fmt.storage not in cpu_kernels_mod.DTYPES:
        return None
    return name


# where choose_row_attention times the two attentions: one 512-row prefill chunk after 3,584 cached tokens (the
# 4k prompt's last chunk), the tier's end where it is shorter
ROWS_MEASURE = (512, 3584)


@torch.no_grad()
def choose_row_attention(model: Transformer, setting: str, cpu_kernels: str, kv_storage: torch.dtype, threads: int,
                         cache_dir: str | None, reps: int = 5) -> dict[str, Any]:
    """Whether a CPU cell's prefill chunks (and its exact decode rows, which must compute what a prefill computes)
    attend through cpu.c's row attention (kernels/paged_decode/cpu.py ``rows_attention``) or model.py's segmented
    flash calls. Sets ``model.row_attention`` (its name, which the cache identity then carries, or None) and returns
    the report (``model.row_attention_report``; the capability's ``runtime.prefill_attention``). Call before the
    cache identity is written: the two compute other bits.

    ``setting`` is MODELD_PREFILL_ATTENTION: "segmented" never takes it; "rows" takes it untimed (errors.Fatal where
    the kernel cannot build or take the model's dtype and heads; a ``kv_storage`` it does not read, quantized or
    fp16, keeps the segmented calls whatever the setting, with the reason); "auto" times one layer's attention of a ROWS_MEASURE chunk both ways, ``reps`` times
    alternately at ``threads``, on seeded random queries and keys in a ``kv_storage`` pool, and takes the row
    attention when its median is the lower; the verdict is kept under ``<cache_dir>/autotune/`` keyed by the CPU,
    threads, dtypes, heads and cpu.c's source, and a later start takes it again (``cached``): it is part of the
    cache identity, so a restarted worker must not flip it on a noisy measurement. ``cpu_kernels`` (MODELD_CPU_KERNELS) "off" builds no C kernel at all."""
    from . import model as M
    from .kernels.paged_decode import cpu as cpu_kernels_mod

    model.row_attention = None
    rep: dict[str, Any] = {"served": "segmented", "setting": setting}
    a = model.args
    dtype = model.compute_dtype
    why = None
    if setting == "segmented":
        why = "MODELD_PREFILL_ATTENTION=segmented"
    elif cpu_kernels == "off":
        why = "MODELD_CPU_KERNELS=off"
    elif not M.chunking_invariant(model.norm.weight.device):
        why = "not the CPU segmented path"
    elif dtype not in cpu_kernels_mod.DTYPES:
        why = f"the row attention computes bf16/fp32, not {dtype}"
    elif kv_storage not in cpu_kernels_mod.DTYPES:
        # not the setting's to refuse: a pool it does not read keeps the segmented calls (as a sibling engine's
        # quantized pool does, rows_attention_serves), whatever MODELD_PREFILL_ATTENTION says
        rep["reason"] = f"the row attention reads a bf16/fp32 KV cache, not {kv_storage}"
        model.row_attention_report = rep
        return rep
    if why is None:
        build = cpu_kernels_mod.load(cache_dir)
        why = build["reason"] if not build["loaded"] else cpu_kernels_mod.rows_refused(a.n_heads, a.n_kv_heads,
                                                                                       a.head_dim)
    if why is not None and setting == "rows":
        raise errors.Fatal(f"MODELD_PREFILL_ATTENTION=rows, but {why}")
    if why is None and setting == "rows":
        rep.update(served=cpu_kernels_mod.ROWS_NAME, reason="MODELD_PREFILL_ATTENTION=rows")
    elif why is None:
        rows, past = ROWS_MEASURE
        past = max(0, min(past, a.max_seq_len - rows))
        # The choice is part of the cache identity (the two attentions compute other bits), so a start that finds it
        # measured here takes it again, as the plain-weights verdict does (loader.keep_plain): measured anew at each
        # start, a noisy start would flip it and a session stored before a restart would be refused as another cell's.
        from .profile_gate import hardware, read_measurement, write_measurement
        key = hashlib.sha256(json.dumps({"v": 1, "hardware": hardware("cpu"), "threads": threads, "dtype": str(dtype),
                                         "kv": str(kv_storage), "heads": [a.n_heads, a.n_kv_heads, a.head_dim],
                                         "at": [rows, past], "source": hashlib.sha256(
                                             cpu_kernels_mod.SOURCE.read_bytes()).hexdigest()},
                                        sort_keys=True).encode()).hexdigest()[:32]
        path = os.path.join(cache_dir, "autotune", f"prefill-attention-{key}.json") if cache_dir else None
        rec = read_measurement(path, key, "report", dict)
        if rec is not None:
            rep = {**rec["report"], "setting": setting, "cached": True}
            if rep.get("served") == cpu_kernels_mod.ROWS_NAME:
                model.row_attention = rep["served"]
            model.row_attention_report = rep
            return rep
        n, bs = past + rows, 16
        g = torch.Generator().manual_seed(23)
        q = torch.randn(rows, a.n_heads, a.head_dim, generator=g).to(dtype)
        kc = torch.randn(-(-n // bs), bs, a.n_kv_heads, a.head_dim, generator=g).to(kv_storage)
        vc = torch.randn(kc.shape, generator=g).to(kv_storage)
        table = torch.arange(kc.shape[0], dtype=torch.int32)
        scale = a.head_dim ** -0.5

        def segmented() -> Tensor:        # as model._attention's CPU prefill: the past widened, then the flash calls
            k, v = kc.view(-1, a.n_kv_heads, a.head_dim)[:n], vc.view(-1, a.n_kv_heads, a.head_dim)[:n]
            return M._segmented_attention(q, k.to(dtype), v.to(dtype), past, scale)

        def rows_fn() -> Tensor:
            return cpu_kernels_mod.rows_attention(q, kc, vc, table, past, scale, threads)

        times: dict[str, list[float]] = {"segmented": [], "rows": []}
        with _intra_op(threads, torch.get_num_threads()):
            for _ in range(reps + 1):                 # the first round is warm-up
                for name, fn in (("segmented", segmented), ("rows", rows_fn)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        ms = {k: round(statistics.median(v[1:]), 2) for k, v in times.items()}
        rep.update(median_ms=ms, rows=rows, past=past, threads=threads, reps=reps)
        if ms["rows"] < ms["segmented"]:
            rep.update(served=cpu_kernels_mod.ROWS_NAME, reason=(
                f"one layer's attention of {rows} rows after {past} cached tokens took {ms['rows']} ms, the "
                f"segmented flash calls {ms['segmented']} ms"))
        else:
            why = (f"the segmented flash calls took {ms['segmented']} ms for one layer's attention of {rows} rows "
                   f"after {past} cached tokens, the row attention {ms['rows']} ms")
    if why is not None:
        rep["reason"] = why
    else:
        model.row_attention = rep["served"]
    if "median_ms" in rep:
        rep["cached"] = False
        write_measurement(path, {"key": key, "report": rep})
    model.row_attention_report = rep
    return rep


def runner_for(backend: str) -> type[TorchRunner]:
    """The model runner class of ``runtime.backend``."""
    if backend == "triton":
        from .triton_runner import TritonRunner
        return TritonRunner
    return TorchRunner
