"""How the CPU cell computes its weights: chosen by a short measurement on this machine, not by a CPU flag.

A ``profile.weights`` value fixes what is stored; several compute paths can serve it:
  fp32, bf16                   dense, in that dtype (the spec pins it: nothing to choose)
  int8                         the int8 weight-only kernel, activations in fp32 or bf16
  q4_1                         the int4 kernel on Q4_1's own blocks, or the blocks dequantized to a dense fp32 / bf16
  fp16, q8_0, q4_k_m           dequantized to a dense fp32 or bf16
bf16 paths are candidates only where this process's torch computes bf16 attention at all.

Each candidate runs, with random weights of the model's real shapes, what one layer of a forward does with its
weights (the four linears) plus the CPU attention at the compute dtype, and the output head: a decode step (1 row
over 1,024 cached keys) and a 256-row prefill chunk after 768 cached tokens. A decode step reads every layer's
weights from memory once, so the decode figure goes through copies of the layer (and of its cached keys) adding up
to the model's layers, or to ``COLD_BYTES`` at most, which no CPU cache holds: timed on one layer's weights, which
stay in the cache, a step came out at 15-22 ms where the served step took 41-49 ms (docs/cell-benchmarks.md,
2026-12-04). A prefill chunk multiplies 256 rows by each weight it reads, so its figure stays one layer's. Dense
weights are measured as the loader serves them: oneDNN-packed; where the packed rows round differently by the call's
row count on this CPU (bf16 with AMX), in fixed row tiles (model.ROW_TILE) when that makes them invariant, else
plain. The choice minimises the time of the agent turn the benchmarks
replay, ``TURN_PREFILL`` appended tokens then ``TURN_DECODE`` greedy ones, with the decode steps at the intra-op
thread count a one-session step is served at: runner.choose_decode_threads measures that on the loaded model and
often takes one thread where prefill takes the process count (waking threads for each of a step's small ops costs
more than they give), and a dense step's weights, read from memory, take longer at one thread than a quantized
kernel's. So the decode step is timed at both counts; the ranking takes the count an earlier start's step measured,
or the process count, and the loader ranks again at the count the loaded step took, building the other path once
where that ranks it first (loader.load_engine), and keeps that count for the next start (record_decode_threads);
the report keeps every candidate's figures, so a reader sees what was measured and why one won. A candidate whose
``TURN_DECODE`` decode steps alone take a whole turn of one measured before it cannot win and gets no prefill
figure (``pruned``). Norms, RoPE and sampling are left out (they cost the same for every candidate, or nearly).

The measurement is cached as JSON under ``<cache>/autotune/<key>.json``, keyed by the hardware and torch
(profile_gate.hardware), the thread count, the model's shapes and ``AUTOTUNE_VERSION``; a second start reads it.
``MODELD_WEIGHTS_PATH`` (EngineSettings.weights_path) names one candidate instead, e.g. ``dense-fp32``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import errors
from .profile_gate import hardware, read_measurement, write_measurement

AUTOTUNE_VERSION = 6                         # 2: dense candidates packed as served; one-row decode attention;
                                             # 3: decode through copies of the layer, not one layer kept in the
                                             #    cache; packed weights measured as loader.pack_and_probe serves
                                             #    them: in row tiles, or plain, where untiled rows are not invariant
                                             # 4: a quantized candidate's head by its own kernel (int8 for a Q8_0
                                             #    head: quantize.head_kernel), not only the format's or dense; a
                                             #    candidate whose decoded tokens alone outlast the best turn so far
                                             #    gets no prefill figure (``pruned``)
                                             # 5: the decode figure at one thread as well as at the process count,
                                             #    ranked at the count the served step takes (rank)
                                             # 6: a dense candidate's decode also timed as the whole-layer C step
                                             #    (decode_step.KernelDecode) where that step may serve it
                                             # (the key names ``blocks`` where that step reads a Q4_1 file's blocks)
COLD_BYTES = 256 << 20                       # at most this many bytes of layer copies for the decode figure
TURN_PREFILL, TURN_DECODE = 700, 32          # the agent turn benchmarks/peers_cpu.py replays (tokens)
PREFILL_ROWS, PREFILL_PAST, DECODE_PAST = 256, 768, 1024

DENSE = ("fp32", "bf16")
QUANT_KERNEL = {"int8": "int8", "q4_1": "q4_1"}     # profile.weights -> the quantized kernel that serves it


@dataclass
class Choice:
    """How the weights are computed: ``kernel`` (dense | int8 | q4_1) in ``dtype`` (fp32 | bf16)."""

    kernel: str
    dtype: str
    reason: str
    candidates: list[dict[str, Any]]    # each: name, kernel, dtype, decode_ms, prefill_ms_per_token, turn_ms
    cached: bool = False
    key: str = ""
    decode_threads: int | None = None   # the intra-op count whose decode figures ranked them (rank)
    others_busy_cores: float | None = None  # what other processes kept busy while it was measured, where known

    @property
    def name(self) -> str:
        return f"{self.kernel}-{self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"name": self.name}


def bf16_computes() -> bool:
    """Whether this process's torch runs the CPU attention and a matmul in bf16 (an ISA limited by
    ATEN_CPU_CAPABILITY=avx2 lacks the bf16 flash kernel: it raises)."""
    from .model import _FLASH_CPU
    if _FLASH_CPU is None:
        return False
    try:
        q = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
        _FLASH_CPU(q, q, q, scale=0.125)
        torch.zeros(2, 64, dtype=torch.bfloat16) @ torch.zeros(64, 2, dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def candidates(weights: str, bf16: bool, kernel_ok: bool = True) -> list[tuple[str, str]]:
    """(kernel, dtype) paths that serve ``profile.weights`` on this CPU. ``kernel_ok`` False: the model file does
    not store its layers in the format's blocks (q4_1), so only the dense paths compute them."""
    if weights in DENSE:
        return [("dense", weights)]
    dtypes = ["fp32", "bf16"] if bf16 else ["fp32"]
    if weights == "int8":
        kernels = [QUANT_KERNEL[weights]]
    else:
        kernels = ["dense"] + ([QUANT_KERNEL[weights]] if weights in QUANT_KERNEL and kernel_ok else [])
    return [(k, d) for k in kernels for d in dtypes]


def _median_ms(fn: Any, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _layer_modules(args: Any, kernel: str, dtype: torch.dtype, g: torch.Generator,
                   head_kernel: str | None = None, pack: bool = False, head: bool = True) -> tuple[list[Any], Any]:
    """One layer's four linears and the head, with random weights of the model's shapes, as the cell would run them
    (``head_kernel``: a quantized candidate's head kernel, quantize.head_kernel's ``dense`` or ``int8`` for a head the
    file keeps finer; None: the candidate's own; ``pack``: a dense layer linear oneDNN-packed, as
    loader.pack_and_probe serves it; the head stays plain; ``head`` False: no head, None in its place)."""
    from .model import RowLinear, can_pack
    from .quantize import quantized_linear

    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    shapes = [(args.dim, qkv), (args.n_heads * args.head_dim, args.dim), (args.dim, 2 * args.intermediate_size),
              (args.intermediate_size, args.dim)] + ([(args.dim, args.vocab_size)] if head else [])
    mods = []
    for i, (k, n) in enumerate(shapes):
        lin = RowLinear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
        kern = head_kernel or kernel if i == 4 and kernel != "dense" else kernel
        dense = kern == "dense"
        mod = lin.to(dtype) if dense else quantized_linear(lin, kern, dtype)
        if dense and pack and i < 4 and can_pack(dtype):
            mod.pack()
        mods.append(mod)
    return mods[:4], (mods[4] if head else None)


def _layer_step_ms(args: Any, dtype: torch.dtype, g: torch.Generator, copies: int, reps: int,
                   blocks: str | None = None) -> dict[str, float]:
    """A dense candidate's decode step as the whole-layer C step serves it (kernels/paged_decode/cpu.c
    ``modeld_decode_layers``, its linears and the attention's keys split over the process's threads, then the head
    by the same row linear): ``copies`` layers of plain random weights and DECODE_PAST cached keys each, one call,
    scaled to the model's layers, plus the head. ``blocks`` ("q4_1", or "q4_1+q8_0" with the head): the step reads
    the file's Q4_1 blocks of the layers (and its Q8_0 head) instead, as the loader gives them to it where the file
    stores them so (decode_step.q4_blocks). Milliseconds: ``layers``, ``head``, ``step``."""
    import ctypes

    from .kernels.paged_decode import cpu as cpu_kernels
    from .quantize import q4_1_blocks, q8_0_blocks

    hq, hkv, d, dim, inter = args.n_heads, args.n_kv_heads, args.head_dim, args.dim, args.intermediate_size
    bs = 16
    n = DECODE_PAST
    nblk = (n + bs - 1) // bs
    held: list[torch.Tensor] = []
    q4 = blocks is not None
    for _ in range(copies):
        lins, _ = _layer_modules(args, "dense", dtype, g, head=False)
        ws = [b for lin in lins for b in q4_1_blocks(lin.weight.detach().float())] if q4 else [
            lin.weight.detach() for lin in lins]
        held += [torch.ones(dim, dtype=dtype), torch.ones(dim, dtype=dtype), *ws,
                 torch.randn(nblk, bs, hkv, d, generator=g).to(dtype), torch.randn(nblk, bs, hkv, d, generator=g).to(dtype)]
    ptrs = (ctypes.c_void_p * len(held))(*[t.data_ptr() for t in held])
    head_w = (torch.randn(args.vocab_size, dim, generator=g) * 0.02).to(dtype)
    head_q8 = q8_0_blocks(head_w.float()) if blocks == "q4_1+q8_0" else None
    x0 = torch.randn(dim, generator=g).to(dtype).float()
    cos, ssin = torch.ones(d), torch.zeros(d)
    table = torch.arange(nblk, dtype=torch.int32)
    threads = torch.get_num_threads()
    bf16 = dtype == torch.bfloat16

    def step() -> None:
        x = x0.clone()
        cpu_kernels.decode_layers(x, ptrs, copies, cos, ssin, n - 1, table, n, bs, (dim, hq, hkv, d, inter), 1e-5,
                                  1.0 / math.sqrt(d), bf16, bf16, threads, q4)

    layers = _median_ms(step, reps * 3) * args.n_layers / copies
    xh = torch.randn(dim, generator=g).to(dtype)
    if head_q8 is not None:
        head = _median_ms(lambda: cpu_kernels.gemv_q8(*head_q8, xh.float(), threads=threads), reps)
    else:
        head = _median_ms(lambda: cpu_kernels.gemv(head_w, xh, threads=threads), reps)
    return {"layers": round(layers, 3), "head": round(head, 3), "step": round(layers + head, 3)}


@torch.inference_mode()
def measure(args: Any, kernel: str, dtype_name: str, reps: int = 5, head: str | None = None,
            pack: bool = False, best_turn_ms: float | None = None, layer_step: bool = False,
            blocks: str | None = None) -> dict[str, Any]:
    """One candidate's figures (milliseconds, whole model: a layer's times x layers, plus the head; the decode step's
    layer time is the mean over ``layer_copies`` distinct copies, each with its own weights and cached keys), the
    decode step at the process count and at one thread (``decode_ms_by_threads``; one thread's with the head at the
    faster count, as runner.choose_decode_threads serves it), and the turn at each (``turn_ms_by_threads``;
    ``decode_ms`` and ``turn_ms`` are the process count's). The decode step is timed first: when ``TURN_DECODE``
    of them (at the faster count) already take ``best_turn_ms`` (another candidate's whole turn) or longer, this one
    cannot win, and its prefill, the slow part to time (q4_1-fp32's took some 7 s of a start on an AMX Xeon), is not
    timed: ``prefill_ms_per_token`` and ``turn_ms`` are then None and ``pruned``
    says why. ``layer_step`` (a dense candidate): its decode is also timed as the whole-layer C step
    (``_layer_step_ms``, whose own threads serve whatever torch's count), recorded as ``layer_step_ms``; each
    thread count's decode figure is then the faster of the two, as the runner serves the faster at start;
    ``blocks``: that step reads the file's blocks (``_layer_step_ms``)."""
    from .model import _segmented_attention, linears_row_invariant, settle_packed_rows

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator().manual_seed(0)
    head_kernel = "dense" if kernel == "dense" else head or kernel
    linears, out = _layer_modules(args, kernel, dtype, g, head_kernel, pack)
    pack_refused, tile = None, 0
    if any(_packed(lin) for lin in linears):
        # as loader.pack_and_probe serves them: in fixed row tiles, or plain, where untiled rows are not invariant
        tile, _, pack_refused = settle_packed_rows(linears, lambda: linears_row_invariant(
            zip(("wqkv", "wo", "w13", "w2"), linears, strict=True), dtype, torch.Generator().manual_seed(1)))
        pack = pack_refused is None
    hq, hkv, d = args.n_heads, args.n_kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(d)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def layer(rows: int, past: int, copies: int = 1) -> Any:
        mods = [linears] + [_layer_modules(args, kernel, dtype, g, head_kernel, pack, head=False)[0]
                            for _ in range(copies - 1)]
        for lins in mods:
            for lin in lins:
                if _packed(lin):
                    lin.tile = tile
        xs = [rand(rows, lin.in_features) for lin in linears]
        q = rand(rows, hq, d)
        kvs = [(rand(past + rows, hkv, d), rand(past + rows, hkv, d)) for _ in range(copies)]

        def run() -> None:
            for lins, (k, v) in zip(mods, kvs, strict=True):
                for lin, x in zip(lins, xs, strict=True):
                    lin(x)
                _segmented_attention(q, k, v, past, scale)
        return run

    copies = layer_copies(args, linears)
    x1 = rand(1, args.dim)
    run = layer(1, DECODE_PAST - 1, copies)
    n = torch.get_num_threads()
    layers_ms, head_at = {}, {}
    try:
        for c in dict.fromkeys((n, 1)):
            torch.set_num_threads(c)
            head_at[c] = _median_ms(lambda: out(x1), reps)
            layers_ms[c] = _median_ms(run, reps * 3) * args.n_layers / copies
    finally:
        torch.set_num_threads(n)
    head_ms = head_at[n]
    # at one thread, the head at whichever count is faster: runner.choose_decode_threads may run it at the process
    # count while the layers take one
    by_threads = {str(c): round(layers_ms[c] + (head_ms if c == n else min(head_at.values())), 3) for c in layers_ms}
    step_ms = _layer_step_ms(args, dtype, g, copies, reps, blocks) if layer_step and kernel == "dense" else None
    if step_ms is not None:
        by_threads = {c: round(min(v, step_ms["step"]), 3) for c, v in by_threads.items()}
    decode = by_threads[str(n)]
    rec = {"name": f"{kernel}-{dtype_name}", "kernel": kernel, "dtype": dtype_name, "decode_ms": decode,
           "prefill_ms_per_token": None, "turn_ms": None, "decode_ms_by_threads": by_threads,
           "turn_ms_by_threads": None, "head": head_kernel, "head_ms": round(head_ms, 3),
           "decode_layer_copies": copies, "packed": any(_packed(lin) for lin in linears), "row_tile": tile,
           "pack_refused": pack_refused, "pruned": None, "layer_step_ms": step_ms}
    fastest = min(by_threads.values())
    if best_turn_ms is not None and TURN_DECODE * fastest >= best_turn_ms:
        rec["pruned"] = (f"its {TURN_DECODE} decoded tokens alone take {TURN_DECODE * fastest:.1f} ms, no less than "
                         f"a whole turn of another candidate ({best_turn_ms:.1f} ms): prefill not timed")
        return rec
    prefill = (_median_ms(layer(PREFILL_ROWS, PREFILL_PAST), reps) * args.n_layers + head_ms) / PREFILL_ROWS
    turns = {c: round(TURN_PREFILL * prefill + TURN_DECODE * d, 1) for c, d in by_threads.items()}
    rec.update(prefill_ms_per_token=round(prefill, 4), turn_ms=turns[str(n)], turn_ms_by_threads=turns)
    return rec


def turn_ms(r: dict[str, Any], threads: int | None) -> float | None:
    """A measured candidate's turn with its decode steps at ``threads`` intra-op threads: the figure at that count,
    or at the process count where that count was not measured or is None (a record from before version 5 has no
    other); None for a pruned candidate."""
    return (r.get("turn_ms_by_threads") or {}).get(str(threads), r["turn_ms"])


def decode_ms(r: dict[str, Any], threads: int) -> float:
    return (r.get("decode_ms_by_threads") or {}).get(str(threads), r["decode_ms"])


def rank(rec: dict[str, Any], decode_threads: int, why: str, cached: bool = False) -> Choice:
    """The candidate of a measurement record (choose's) with the shortest turn when a one-session step decodes at
    ``decode_threads`` threads (``why`` says where that count comes from). Prefill keeps the process count."""
    threads = rec["threads"]
    contended = ""
    if (rec.get("others_busy_cores") or 0) > MAX_OTHERS_BUSY:
        contended = (f"; measured while other processes kept {rec['others_busy_cores']:.2f} cores busy (over "
                     f"{MAX_OTHERS_BUSY}): measured again at a start that finds the machine quiet")
    rows = rec["candidates"]
    best = min((r for r in rows if turn_ms(r, decode_threads) is not None), key=lambda r: turn_ms(r, decode_threads))
    others = ", ".join(f"{r['name']} " + (f"{turn_ms(r, decode_threads)} ms" if r["turn_ms"] is not None else
                                          f"over {TURN_DECODE * decode_ms(r, decode_threads):.1f} ms (decode alone)")
                       for r in rows if r is not best)
    reason = (f"measured on this CPU ({threads} threads; decoding at {decode_threads}, {why}): a {TURN_PREFILL}-token "
              f"append + {TURN_DECODE} decoded tokens takes {turn_ms(best, decode_threads)} ms ({others}){contended}")
    return Choice(best["kernel"], best["dtype"], reason, rows, cached=cached, key=rec["key"],
                  decode_threads=decode_threads, others_busy_cores=rec.get("others_busy_cores"))


def record_decode_threads(cache_dir: str | None, key: str, threads: int) -> bool:
    """Keep in the measurement record ``key`` the count a one-session step of the chosen path took at start
    (runner.choose_decode_threads), so that the next choose ranks the candidates at it. False where there is no
    such record (no cache)."""
    path = os.path.join(cache_dir, "autotune", f"{key}.json") if cache_dir else None
    rec = read_measurement(path, key, "candidates", list)
    if rec is None:
        return False
    if rec.get("decode_threads") != threads:
        write_measurement(path, {**rec, "decode_threads": threads})
    return True


def _packed(lin: Any) -> bool:
    """A dense layer linear holding its weight oneDNN-packed (RowLinear.pack; not a quantized kernel's codes)."""
    from .model import RowLinear
    return isinstance(lin, RowLinear) and lin.packed is not None


def layer_copies(args: Any, linears: list[Any]) -> int:
    """How many copies of one layer's weights and cached keys the decode figure goes through: the model's layer
    count, or as many as ``COLD_BYTES`` holds (at least one)."""
    weights = sum(t.numel() * t.element_size() for lin in linears for t in (*lin.parameters(), *lin.buffers()))
    return max(1, min(args.n_layers, COLD_BYTES // max(1, weights)))


# Other processes' busy cores (from /proc/stat, less this process's own CPU time) above which a measurement counts as
# contended: one made while a compiler ran beside it ranked the paths by the compiler's load. It is cached (a busy
# node's every start would otherwise measure again) and measured again by the first start that finds the machine
# quiet (quiet_now)
MAX_OTHERS_BUSY = 0.25
QUIET_SAMPLE_S = 0.2


def quiet_now(sample_s: float = QUIET_SAMPLE_S) -> bool:
    """Other processes keep at most MAX_OTHERS_BUSY cores busy over the next ``sample_s`` seconds."""
    busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.monotonic()
    time.sleep(sample_s)
    others = other_busy_cores(busy0, own0, wall0)
    return others is not None and others <= MAX_OTHERS_BUSY


def machine_busy_s() -> float | None:
    """CPU-seconds the whole machine has spent busy (all cores), from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")        # less idle and iowait


def other_busy_cores(busy0: float | None, own0: float, wall0: float) -> float | None:
    """Cores other processes kept busy since (busy0, own0, wall0) = (machine_busy_s(), time.process_time(),
    time.monotonic()); None where /proc/stat is not readable."""
    busy1, wall = machine_busy_s(), time.monotonic() - wall0
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return max(0.0, (busy1 - busy0 - (time.process_time() - own0)) / wall)


def _key(args: Any, cands: list[tuple[str, str]], threads: int, head: str | None, pack: bool = False,
         layer_step: bool = False, blocks: str | None = None) -> str:
    shapes = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                            "intermediate_size", "vocab_size")}
    payload = {"v": AUTOTUNE_VERSION, "hardware": hardware("cpu"), "threads": threads, "shapes": shapes,
               "candidates": cands, "head": head, "pack": pack}
    if layer_step:                      # (absent otherwise: the key of a measurement without it is unchanged)
        from .kernels.paged_decode import cpu as cpu_kernels
        payload["layer_step"] = hashlib.sha256(cpu_kernels.SOURCE.read_bytes()).hexdigest()[:16]
        if blocks is not None:
            payload["blocks"] = blocks
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def choose(args: Any, weights: str, cache_dir: str | None, forced: str = "auto", head: str | None = None,
           kernel_ok: bool = True, pack: bool = False, decode_threads: int | None = None,
           layer_step: bool = False, blocks: str | None = None) -> Choice:
    """The compute path for ``profile.weights`` = ``weights`` on this CPU. ``forced`` (MODELD_WEIGHTS_PATH) names
    one candidate (``kernel-dtype``) to take without measuring; one that does not serve ``weights`` here is refused.
    ``head``: a quantized candidate's head kernel (quantize.head_kernel; None: the candidate's own).
    ``decode_threads`` (MODELD_DECODE_THREADS as a count): the count a one-session step decodes at; None (auto):
    the count an earlier start's step measured (record_decode_threads), else the process count; the loader ranks
    again at the count the served step then takes (loader.load_engine). ``layer_step``: the whole-layer C step may
    serve a dense path's decode (loader._layer_step_may_serve): it is timed too (``measure``), reading the file's
    ``blocks`` where it stores its layers so ("q4_1", "q4_1+q8_0" with its head)."""
    cands = candidates(weights, bf16_computes(), kernel_ok)
    names = [f"{k}-{d}" for k, d in cands]
    if forced != "auto":
        if forced not in names:
            raise errors.BadRequest(f"MODELD_WEIGHTS_PATH {forced!r} does not serve profile.weights {weights!r} on "
                                    f"this CPU (its paths: {', '.join(names)})", field="profile.weights",
                                    value=weights)
        k, d = cands[names.index(forced)]
        return Choice(k, d, f"MODELD_WEIGHTS_PATH={forced}", [])
    if len(cands) == 1:
        k, d = cands[0]
        return Choice(k, d, f"profile.weights {weights} pins it", [])
    threads = torch.get_num_threads()
    key = _key(args, cands, threads, head, pack, layer_step, blocks if layer_step else None)
    path = os.path.join(cache_dir, "autotune", f"{key}.json") if cache_dir else None
    rec = read_measurement(path, key, "candidates", list)
    if rec is not None and (rec.get("others_busy_cores") or 0) > MAX_OTHERS_BUSY and quiet_now():
        rec = None                   # measured while the machine was busy, and it is quiet now: measure again
    cached = rec is not None
    if rec is None:
        busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.monotonic()
        figures: list[dict[str, Any]] = []
        for k, d in cands:
            turns = [min(r["turn_ms_by_threads"].values()) for r in figures if r["turn_ms"] is not None]
            figures.append(measure(args, k, d, head=head, pack=pack, best_turn_ms=min(turns) if turns else None,
                                   layer_step=layer_step, blocks=blocks))
        rec = {"key": key, "candidates": figures, "threads": threads,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        busy = other_busy_cores(busy0, own0, wall0)
        if busy is not None:
            rec["others_busy_cores"] = round(busy, 2)
        write_measurement(path, rec)
    if decode_threads in (1, threads):
        return rank(rec, decode_threads, "MODELD_DECODE_THREADS", cached)
    if decode_threads is not None:
        return rank(rec, threads, f"MODELD_DECODE_THREADS={decode_threads} is not measured: the process count",
                    cached)
    if rec.get("decode_threads"):
        return rank(rec, rec["decode_threads"], "as a loaded one-session step measured it at a start here", cached)
    return rank(rec, threads, "the process count, until a start measures its decode step", cached)
