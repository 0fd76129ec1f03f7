"""Paged GQA decode attention on the CPU: ``cpu.c`` built with the machine's C compiler, loaded with ctypes.

Layout as reference.py (vLLM "NHD"). The kernel reads one query row's keys and values in place through its block
table (no gather, no concatenation), in fp32 math, AVX-512 where the compiler targets it (``-march=native``), else
portable C. It serves the recomputing decode step only (decode_step.py, MODELD_DECODED_KV=recompute), whose K/V the
next prefill computes again: its summation order is not a prefill's, and nothing reused ever holds its rounding.

Building: ``load(cache_dir)`` compiles ``cpu.c`` once per (source, compiler, flags, CPU) into
``<cache_dir>/kernels/`` (a temporary directory when cache_dir is None) and checks the loaded library against
``reference.paged_decode`` on seeded random pages (``self_check``) before anything calls it; a machine without a
C compiler, a failed build or a failed check leaves the kernel off, with the reason. Like vLLM's and SGLang's CPU
backends, whose C++ attention kernels are compiled for the CPU; here at start rather than at install, since the
package ships no binaries.

The op ``torch.ops.modeld.paged_decode_cpu`` is registered at import (the scripted decode step names it) and
raises until ``load`` has succeeded.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu.c")
# -ffast-math's code generation, spelled out: given as -ffast-math (or -funsafe-math-optimizations) to a link, gcc
# (12 at least) adds crtfastmath.o even to a shared library, whose constructor sets the CPU's flush-to-zero and
# denormals-are-zero bits for the whole process on load: every torch op after it then computed with subnormals
# flushed (a library the worker loads at start must not change the numerics of the rest of the process).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math", "-fassociative-math",
         "-freciprocal-math", "-ffinite-math-only", "-fno-rounding-math", "-fno-signaling-nans",
         "-fcx-limited-range", "-fexcess-precision=fast", "-fPIC", "-shared", "-pthread")
# the self-check's bound on |kernel - reference| against the reference's own scale (fp32 math both; bf16 rounds the
# output once): wider than either rounding, far narrower than a wrong head, mask or scale. The row linear (gemv) is
# checked against F.linear in fp64 on the same bf16/fp32 inputs: fp32 sums in another order, so the same bounds.
CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# the quantized row linears' bound on the same scale: their AVX2 loops hold x in 16-bit fixed point per 32-group
# (within 2^-16 of the group's largest |x|), some 1e-5 of a row's scale on these inputs; a wrong code, nibble order or
# scale is off by far more
CHECK_TOL_BLOCKS = 1e-3

_lock = threading.Lock()
_lib: Any = None
_report: dict[str, Any] | None = None

_lib_def = torch.library.Library("modeld", "FRAGMENT")
_lib_def.define("paged_decode_cpu(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int n, float scale) -> Tensor")


def _paged_decode_cpu(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, n: int, scale: float) -> Tensor:
    """q [1, Hq, D] or [Hq, D] (bf16/fp32); k_cache, v_cache [NB, BS, Hkv, D] (bf16/fp32, contiguous); table int32
    [>= ceil(n / BS)]; n tokens attended. Returns out shaped as q, in q's dtype."""
    if _lib is None:
        raise RuntimeError("the CPU paged-decode kernel is not loaded (kernels.paged_decode.cpu.load)")
    hq, d = q.shape[-2], q.shape[-1]
    bs, hkv = _check_paged(q, k_cache, v_cache, table, "the CPU kernel")
    if n < 1 or table.numel() * bs < n:
        raise ValueError(f"n={n} is not covered by a block table of {table.numel()} blocks of {bs}")
    q = q.contiguous()
    table = table.contiguous()
    out = torch.empty_like(q)
    rc = _lib.modeld_paged_decode(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                  table.data_ptr(), n, bs, hq, hkv, d, scale, int(k_cache.dtype == torch.bfloat16),
                                  int(q.dtype == torch.bfloat16))
    if rc != 0:
        raise RuntimeError(f"modeld_paged_decode returned {rc} (1: a head shape it does not take, 2: out of memory) "
                           f"for Hq={hq}, Hkv={hkv}, D={d}, n={n}")
    return out


_lib_def.impl("paged_decode_cpu", _paged_decode_cpu, "CPU")
# the row attention (rows_attention below), for the scripted exact decode step where a prefill attends through it
_lib_def.define("rows_attention_cpu(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int q0, float scale) -> "
                "Tensor")


# the dtypes cpu.c reads and computes in, for queries and paged caches alike (fp16 and quantized pools are not read)
DTYPES = (torch.float32, torch.bfloat16)


def _check_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, who: str) -> tuple[int, int]:
    """ValueError naming what a C kernel reading paged caches cannot take; else (BLOCK_SIZE, Hkv)."""
    _, bs, hkv, dk = k_cache.shape
    if dk != q.shape[-1] or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if k_cache.dtype not in DTYPES or q.dtype not in DTYPES:
        raise ValueError(f"{who} takes fp32/bf16, got q {q.dtype}, cache {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or table.dtype != torch.int32:
        raise ValueError(f"{who} takes contiguous caches and an int32 block table")
    return bs, hkv


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 sm_scale: float | None = None) -> Tensor:
    """reference.paged_decode's contract (no LSE), one row at a time through the loaded kernel: q [B, Hq, D];
    block_tables [B, MB] int32; seq_lens [B] int32, each >= 1. Returns out [B, Hq, D] in q.dtype."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    return torch.stack([torch.ops.modeld.paged_decode_cpu(q[b], k_cache, v_cache, block_tables[b],
                                                          int(seq_lens[b]), scale) for b in range(q.shape[0])])


def _compiler() -> str | None:
    cc = os.environ.get("CC", "").strip()
    return shutil.which(cc) if cc else (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU model and flags (a library built on one CPU never loads on another)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def load(cache_dir: str | None) -> dict[str, Any]:
    """Build (or find built) and load the kernel, then check it against the reference. Returns the report:
    ``loaded`` (bool), ``reason``, and when loaded ``isa`` (avx512 | avx2 | portable: the attention and dense row
    linear's loop; ``q4_isa``, avx2 | portable: the Q4_1 and Q8_0 row linears'; ``rows_isa``, avx2 or None: the
    row attention's, ``rows_attention``), ``compiler``, ``library``,
    ``built_s`` (0 when found built), ``check`` (max error per dtype). Thread-safe; the first success stays."""
    global _lib, _report
    with _lock:
        if _lib is not None and _report is not None:
            return _report
        _report = _load(cache_dir)
        return _report


def loaded() -> bool:
    return _lib is not None


def _load(cache_dir: str | None) -> dict[str, Any]:
    global _lib
    cc = _compiler()
    if cc is None:
        return {"loaded": False, "reason": "no C compiler on PATH (cc, gcc or clang; or CC): the kernel is not built"}
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"loaded": False, "reason": f"{cc} --version failed: {e}"}
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, version.encode(), " ".join(FLAGS).encode(), _cpu_id().encode(),
                                     torch.__version__.encode()])).hexdigest()[:16]
    root = Path(cache_dir) / "kernels" if cache_dir else Path(tempfile.gettempdir()) / "modeld-kernels"
    lib_path = root / f"paged_decode_cpu-{key}.so"
    built_s = 0.0
    if not lib_path.exists():
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        t0 = time.perf_counter()
        try:
            root.mkdir(parents=True, exist_ok=True)
            r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                               timeout=300)
        except (OSError, subprocess.SubprocessError) as e:      # an unwritable cache, a compiler that hangs
            return {"loaded": False, "reason": f"building into {root} failed: {e}"}
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            err = (r.stderr.strip().splitlines() or ["(no output)"])[0][:300]
            return {"loaded": False, "reason": f"{Path(cc).name} could not build cpu.c: {err}"}
        try:
            os.replace(tmp, lib_path)      # atomic: a concurrent start finds a whole library or none
        except OSError as e:
            return {"loaded": False, "reason": f"building into {root} failed: {e}"}
        built_s = time.perf_counter() - t0
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as e:
        return {"loaded": False, "reason": f"the built kernel does not load: {e}"}
    lib.modeld_paged_decode.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 3 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.modeld_paged_decode.restype = ctypes.c_int
    lib.modeld_paged_decode_isa.restype = ctypes.c_int
    lib.modeld_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    lib.modeld_gemv.restype = None
    lib.modeld_decode_layers.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_int] * 5 + [
        ctypes.c_float] * 2 + [ctypes.c_int] * 4
    lib.modeld_gemv_q4.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.modeld_gemv_q4.restype = ctypes.c_int
    lib.modeld_gemv_q4_isa.restype = ctypes.c_int
    lib.modeld_gemv_q8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.modeld_gemv_q8.restype = ctypes.c_int
    lib.modeld_decode_layers.restype = ctypes.c_int
    lib.modeld_prefill_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3 + [
        ctypes.c_float] + [ctypes.c_int] * 3
    lib.modeld_prefill_attention.restype = ctypes.c_int
    lib.modeld_prefill_attention_isa.restype = ctypes.c_int
    _lib = lib
    try:
        check = self_check()
        check.update(gemv_check())
        check.update(gemv_q4_check())
        if lib.modeld_prefill_attention_isa():
            check.update(rows_check())
    except Exception as e:        # a kernel that disagrees with the reference never serves
        _lib = None
        return {"loaded": False, "reason": f"the built kernel failed its check against the reference: {e}"}
    return {"loaded": True, "reason": "built and checked against reference.paged_decode, F.linear and fp64 causal attention", "isa":
            {1: "avx512", 2: "avx2"}.get(lib.modeld_paged_decode_isa(), "portable"),
            "q4_isa": "avx2" if lib.modeld_gemv_q4_isa() else "portable",
            "rows_isa": "avx2" if lib.modeld_prefill_attention_isa() else None, "compiler": version.splitlines()[0][:120],
            "library": str(lib_path), "built_s": round(built_s, 2), "check": check}


def self_check() -> dict[str, float]:
    """The loaded kernel against reference.paged_decode on seeded random pages: GQA 3:1 and 1:1, D 64 and 40 (the
    AVX-512 loop where the build has it, and the portable one), a shuffled block table, a partial last block, fp32
    and bf16 caches. Raises
    AssertionError naming the case past CHECK_TOL; returns the largest relative error per dtype."""
    from . import reference as ref

    g = torch.Generator().manual_seed(0)
    worst: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for hq, hkv, d, n in ((9, 3, 64, 77), (4, 4, 40, 33)):
            bs = 16
            nb = (n + bs - 1) // bs + 2
            kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
            vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
            q = torch.randn(1, hq, d, generator=g).to(dtype)
            table = torch.randperm(nb, generator=g)[: (n + bs - 1) // bs].to(torch.int32)[None]
            lens = torch.tensor([n], dtype=torch.int32)
            want = ref.paged_decode(q.float(), kc.float(), vc.float(), table, lens, sm_scale=0.2)
            got = paged_decode(q, kc, vc, table, lens, sm_scale=0.2).float()
            err = float((got - want).abs().max() / want.abs().max())
            if not err <= CHECK_TOL[dtype]:
                raise AssertionError(f"{dtype} Hq={hq} Hkv={hkv} D={d} n={n}: relative error {err:.3g} over "
                                     f"{CHECK_TOL[dtype]}")
            name = str(dtype).replace("torch.", "")
            worst[name] = round(max(worst.get(name, 0.0), err), 8)
    return worst


def gemv(w: Tensor, x: Tensor, portable: bool = False, threads: int = 1) -> Tensor:
    """y [N] fp32 = w [N, K] @ x [K] as the layer step's linears compute it (fp32 sums; w and x one dtype, bf16 or
    fp32, contiguous). ``portable``: the portable loop, whatever the build targets; ``threads``: the rows split over
    the kernel's helper threads."""
    if _lib is None:
        raise RuntimeError("the CPU paged-decode kernel is not loaded (kernels.paged_decode.cpu.load)")
    if w.dim() != 2 or x.shape != (w.shape[1],) or w.dtype != x.dtype or w.dtype not in (torch.float32,
                                                                                       torch.bfloat16):
        raise ValueError(f"gemv takes w [N, K] and x [K] of one dtype (fp32/bf16), got {tuple(w.shape)} "
                         f"{w.dtype} and {tuple(x.shape)} {x.dtype}")
    w, x = w.contiguous(), x.contiguous()
    y = torch.empty(w.shape[0], dtype=torch.float32)
    _lib.modeld_gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), w.shape[0], w.shape[1],
                     int(w.dtype == torch.bfloat16), int(portable), threads)
    return y


def _row_linear_error(what: str, want: Tensor, run: Any, tol: float) -> float:
    """The largest relative error of ``run(portable, threads)`` against ``want`` (fp64) over the build's loop on
    one thread and two and the portable one; AssertionError naming ``what`` and the case past ``tol``."""
    worst = 0.0
    for portable, threads in ((False, 1), (True, 1), (False, 2)):
        got = run(portable, threads).double()
        err = float((got - want).abs().max() / want.abs().max())
        if not err <= tol:
            raise AssertionError(f"{what} portable={portable} threads={threads}: relative error {err:.3g} over {tol}")
        worst = max(worst, err)
    return worst


def gemv_check() -> dict[str, float]:
    """The loaded row linear against F.linear in fp64 on seeded inputs: row counts off and on its 16-row groups, K
    off and on its 16/32-element steps, both dtypes, the build's loop (on one thread and two) and the portable one.
    Raises AssertionError naming the case past CHECK_TOL; returns the largest relative error per dtype (keys
    ``gemv_<dtype>``)."""
    g = torch.Generator().manual_seed(1)
    worst: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((48, 64), (37, 40), (16, 576), (5, 19)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(k, generator=g).to(dtype)
            err = _row_linear_error(f"gemv {dtype} N={n} K={k}", w.double() @ x.double(),
                                    lambda portable, threads: gemv(w, x, portable, threads),  # noqa: B023
                                    CHECK_TOL[dtype])
            name = "gemv_" + str(dtype).replace("torch.", "")
            worst[name] = round(max(worst.get(name, 0.0), err), 8)
    return worst


def gemv_q4(qs: Tensor, d: Tensor, m: Tensor, x: Tensor, portable: bool = False, threads: int = 1) -> Tensor:
    """y [N] fp32 = the Q4_1 blocks (quantize.q4_1_blocks: qs [N, K/2] uint8, d, m [N, K/32] fp32) times x [K] fp32,
    as the layer step's Q4_1 linears compute it. ``portable``: the portable loop whatever the build targets;
    ``threads``: the rows split over the kernel's helper threads."""
    if _lib is None:
        raise RuntimeError("the CPU paged-decode kernel is not loaded (kernels.paged_decode.cpu.load)")
    n, k = qs.shape[0], qs.shape[1] * 2
    if (qs.dtype != torch.uint8 or x.shape != (k,) or x.dtype != torch.float32 or k % 32
            or d.shape != (n, k // 32) or m.shape != d.shape or d.dtype != torch.float32 or m.dtype != torch.float32):
        raise ValueError(f"gemv_q4 takes qs [N, K/2] uint8, d, m [N, K/32] fp32 and x [K] fp32 (K a multiple of 32), "
                         f"got {tuple(qs.shape)} {qs.dtype}, {tuple(d.shape)} {d.dtype}, {tuple(x.shape)} {x.dtype}")
    qs, d, m, x = qs.contiguous(), d.contiguous(), m.contiguous(), x.contiguous()
    y = torch.empty(n, dtype=torch.float32)
    rc = _lib.modeld_gemv_q4(qs.data_ptr(), d.data_ptr(), m.data_ptr(), x.data_ptr(), y.data_ptr(), n, k,
                             int(portable), threads)
    if rc != 0:
        raise RuntimeError(f"modeld_gemv_q4 returned {rc} for N={n}, K={k}")
    return y


def gemv_q8(qs: Tensor, d: Tensor, x: Tensor, portable: bool = False, threads: int = 1) -> Tensor:
    """y [N] fp32 = the Q8_0 blocks (quantize.q8_0_blocks: qs [N, K] int8, d [N, K/32] fp32) times x [K] fp32, as
    the layer step's head computes it."""
    if _lib is None:
        raise RuntimeError("the CPU paged-decode kernel is not loaded (kernels.paged_decode.cpu.load)")
    n, k = qs.shape
    if qs.dtype != torch.int8 or x.shape != (k,) or x.dtype != torch.float32 or k % 32 or d.shape != (n, k // 32) \
            or d.dtype != torch.float32:
        raise ValueError(f"gemv_q8 takes qs [N, K] int8, d [N, K/32] fp32 and x [K] fp32 (K a multiple of 32), got "
                         f"{tuple(qs.shape)} {qs.dtype}, {tuple(d.shape)} {d.dtype}, {tuple(x.shape)} {x.dtype}")
    qs, d, x = qs.contiguous(), d.contiguous(), x.contiguous()
    y = torch.empty(n, dtype=torch.float32)
    rc = _lib.modeld_gemv_q8(qs.data_ptr(), d.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, int(portable), threads)
    if rc != 0:
        raise RuntimeError(f"modeld_gemv_q8 returned {rc} for N={n}, K={k}")
    return y


def gemv_q4_check() -> dict[str, float]:
    """The loaded Q4_1 and Q8_0 row linears against their blocks dequantized (quantize.dequantize_q4_1, d * q) times x
    in fp64, on seeded inputs: odd and even row counts, one group and many, the build's loop (one thread and two)
    and the portable one. Raises AssertionError naming the case past CHECK_TOL_BLOCKS; returns the largest relative
    error (key ``gemv_q4``)."""
    from modeld_cell.quantize import dequantize_q4_1, q4_1_blocks, q8_0_blocks, quantize_q4_1

    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for n, k in ((5, 32), (48, 576), (37, 96)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(k, generator=g)
        qs, d, m = q4_1_blocks(w)
        want = dequantize_q4_1(*quantize_q4_1(w)).double() @ x.double()
        worst = max(worst, _row_linear_error(f"gemv_q4 N={n} K={k}", want, lambda portable, threads: gemv_q4(
            qs, d, m, x, portable, threads), CHECK_TOL_BLOCKS))  # noqa: B023
        q8, d8 = q8_0_blocks(w)
        want = (q8.view(n, k // 32, 32).double() * d8.double()[..., None]).view(n, k) @ x.double()
        worst = max(worst, _row_linear_error(f"gemv_q8 N={n} K={k}", want, lambda portable, threads: gemv_q8(
            q8, d8, x, portable, threads), CHECK_TOL_BLOCKS))  # noqa: B023
    return {"gemv_q4": round(worst, 8)}


def decode_layers(x: Tensor, ptrs: Any, n_layers: int, cos: Tensor, ssin: Tensor, slot: int, table: Tensor, n: int,
                  bs: int, dims: tuple[int, int, int, int, int], eps: float, scale: float, bf16: bool,
                  kv_bf16: bool, threads: int = 1, q4: bool = False) -> None:
    """Every layer of one decode row, in place on x [dim] fp32 (cpu.c's modeld_decode_layers). ptrs: a ctypes
    array of L_PTRS (8) pointers a layer; cos, ssin [D] fp32 contiguous; table int32 contiguous covering n;
    dims (dim, Hq, Hkv, D, intermediate); threads: the linears' rows split over that many threads; q4: the linears
    are Q4_1 blocks (cpu.c's Q_PTRS, 16 pointers a layer: each linear's qs, d, m). The caller
    (decode_step.KernelDecode) keeps every pointed tensor alive."""
    if _lib is None:
        raise RuntimeError("the CPU paged-decode kernel is not loaded (kernels.paged_decode.cpu.load)")
    dim, hq, hkv, d, inter = dims
    rc = _lib.modeld_decode_layers(x.data_ptr(), ptrs, n_layers, cos.data_ptr(), ssin.data_ptr(), slot,
                                   table.data_ptr(), n, bs, dim, hq, hkv, d, inter, eps, scale, int(bf16),
                                   int(kv_bf16), threads, int(q4))
    if rc != 0:
        raise RuntimeError(f"modeld_decode_layers returned {rc} (1: a shape it does not take, 2: out of memory) "
                           f"for dim={dim}, Hq={hq}, Hkv={hkv}, D={d}, intermediate={inter}, n={n}")


# keys per block of the row attention (cpu.c's PA_KB): a row's sums run block by block at absolute multiples of it,
# so it is part of what a prefill computes (the cache identity names it: ROWS_NAME)
ROWS_BLOCK = 64
ROWS_NAME = f"cpu.c rows (avx2, {ROWS_BLOCK}-key blocks)"


def rows_refused(hq: int, hkv: int, d: int) -> str | None:
    """Why the loaded build's row attention cannot take these heads, or None when it can."""
    if _lib is None:
        return "the CPU kernels are not loaded"
    if not _lib.modeld_prefill_attention_isa():
        return "the build has no row attention loop (it needs AVX2 and FMA)"
    if hkv < 1 or hq % hkv or hq // hkv > 16 or d % 32 or d > 256:
        return f"Hq={hq}, Hkv={hkv}, D={d}: the row attention takes up to 16 query heads a KV head and D a multiple " \
               "of 32 up to 256"
    return None


def rows_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, q0: int, scale: float,
                   threads: int | None = None) -> Tensor:
    """Causal attention of q's T rows at positions q0 .. q0 + T - 1 over keys 0 .. their own position, read through
    ``table`` from the paged caches (which already hold the rows' own keys): cpu.c's modeld_prefill_attention. Each
    row's result depends only on its position, its query and those keys, whatever rows share the call (chunking
    invariance by construction). q [T, Hq, D] bf16/fp32; caches [NB, BS, Hkv, D] bf16/fp32, contiguous; table int32
    covering q0 + T keys; threads: the pool's (default: torch's intra-op count). Returns [T, Hq, D] in q's dtype."""
    if _lib is None:
        raise RuntimeError("the CPU kernels are not loaded (kernels.paged_decode.cpu.load)")
    t, hq, d = q.shape
    bs, hkv = _check_paged(q, k_cache, v_cache, table, "the row attention")
    if q0 < 0 or t < 1 or table.numel() * bs < q0 + t:
        raise ValueError(f"{q0} + {t} keys are not covered by a block table of {table.numel()} blocks of {bs}")
    q, table = q.contiguous(), table.contiguous()
    out = torch.empty_like(q)
    rc = _lib.modeld_prefill_attention(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                       table.data_ptr(), q0, t, bs, hq, hkv, d, scale,
                                       int(k_cache.dtype == torch.bfloat16), int(q.dtype == torch.bfloat16),
                                       threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"modeld_prefill_attention returned {rc} (1: a head shape or build it does not take, 2: "
                           f"out of memory) for Hq={hq}, Hkv={hkv}, D={d}, T={t}")
    return out


_lib_def.impl("rows_attention_cpu", lambda q, k_cache, v_cache, table, q0, scale: rows_attention(
    q, k_cache, v_cache, table, q0, scale), "CPU")


def causal_reference(q: Tensor, k: Tensor, v: Tensor, q0: int, scale: float) -> Tensor:
    """fp64 causal GQA attention of q [T, Hq, D] at positions q0.. over k, v [q0 + T, Hkv, D] (the row attention's
    ground truth)."""
    t, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    s = torch.einsum("thgd,nhd->thgn", q.double().view(t, hkv, hq // hkv, d), k.double()) * scale
    past = torch.arange(n)[None, :] > (q0 + torch.arange(t))[:, None]
    p = s.masked_fill(past[:, None, None, :], -math.inf).softmax(-1)
    return torch.einsum("thgn,nhd->thgd", p, v.double()).reshape(t, hq, d)


def rows_check() -> dict[str, float]:
    """The loaded row attention against ``causal_reference`` on seeded pages (a shuffled block table, GQA 3:1 and
    4:1, D 64 and 32, fp32 and bf16 caches, past and across 64-key blocks), and the property it exists for: the
    same rows computed in one call, in chunks cut anywhere (one row included) and on one thread or two give the same
    bits. Raises AssertionError naming the case; returns the largest relative error (key ``rows``)."""
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for dtype, (hq, hkv, d), n in ((torch.float32, (9, 3, 64), 150), (torch.bfloat16, (8, 2, 32), 137)):
        bs = 16
        nb = (n + bs - 1) // bs + 2
        kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
        table = torch.randperm(nb, generator=g)[: (n + bs - 1) // bs].to(torch.int32)
        q = torch.randn(n, hq, d, generator=g).to(dtype)
        k = kc[table.long()].reshape(-1, hkv, d)[:n]
        v = vc[table.long()].reshape(-1, hkv, d)[:n]
        full = rows_attention(q, kc, vc, table, 0, 0.2, threads=2)
        want = causal_reference(q, k, v, 0, 0.2)
        err = float((full.double() - want).abs().max() / want.abs().max())
        if not err <= CHECK_TOL[dtype]:
            raise AssertionError(f"rows {dtype} Hq={hq} Hkv={hkv} D={d}: relative error {err:.3g} over "
                                 f"{CHECK_TOL[dtype]}")
        worst = max(worst, err)
        cuts = (0, 1, 2, 63, 64, 65, 100, n - 1, n)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            part = rows_attention(q[a:b], kc, vc, table, a, 0.2, threads=1 + i % 2)
            if not torch.equal(part, full[a:b]):
                raise AssertionError(f"rows {dtype}: rows {a}..{b} computed alone differ from the same rows of one "
                                     f"{n}-row call")
    return {"rows": round(worst, 8)}
