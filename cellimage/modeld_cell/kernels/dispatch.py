"""The one seam between the model and the kernels: pick triton on CUDA, the torch reference elsewhere.

Backend choice, strongest first:
  1. ``force=`` argument of any function here ("torch" | "triton");
  2. environment variable MODELD_KERNEL_BACKEND ("torch" | "triton" | "auto"; read on every call);
  3. auto: "triton" for CUDA tensors when triton imports, else "torch".
Forcing "triton" for CPU tensors means the triton interpreter, which needs TRITON_INTERPRET=1 in the environment
before triton is first imported; without it BackendUnavailable is raised rather than failing inside triton.
Importing this module never imports triton, so it works on machines without it (only "torch" is offered there).
All LSE values are NATURAL LOG.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from .merge import reference as _merge_ref
from .paged_decode import reference as _paged_ref
from .paged_prefill import reference as _prefill_ref
from .quant_kv import reference as _quant_ref
from .sparse_prefill import reference as _sparse_ref

ENV_VAR = "MODELD_KERNEL_BACKEND"
BACKENDS = ("torch", "triton")

_triton_error: str | None = None  # why triton failed to import, once tried
_triton_checked = False


class BackendUnavailable(RuntimeError):
    """A forced backend cannot run here (triton missing, or triton on CPU without TRITON_INTERPRET=1)."""


def triton_available() -> bool:
    """True when triton imports; the first call tries the import and caches the answer."""
    global _triton_checked, _triton_error
    if not _triton_checked:
        _triton_checked = True
        try:
            importlib.import_module("triton")
        except Exception as exc:  # ImportError, or a broken install raising anything else
            _triton_error = f"{type(exc).__name__}: {exc}"
    return _triton_error is None


def cpu_bf16_attention_error() -> str | None:
    """Why this process's torch cannot run CPU flash attention in bf16, or None when it can. Under
    ATEN_CPU_CAPABILITY=avx2 (or a CPU without AVX-512) a prefill-sized call raises "pack_vnni2 is only supported
    when avx512 is supported"; small calls take another path, so the probe uses 512 rows."""
    q = torch.zeros(1, 1, 512, 64, dtype=torch.bfloat16)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True, scale=0.125)
    except RuntimeError as e:
        return str(e)
    return None


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET is set to a true value (triton then runs kernels on CPU tensors, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on device: always "torch"; "triton" on CUDA, or on CPU under the interpreter."""
    dev = torch.device(device)
    ok = triton_available() and (dev.type == "cuda" or interpreter_enabled())
    return ["torch", "triton"] if ok else ["torch"]


def get_backend(device: torch.device | str, force: str | None = None) -> str:
    """Resolve "torch" or "triton" for tensors on device (order: force, $MODELD_KERNEL_BACKEND, auto)."""
    dev = torch.device(device)
    choice = force if force is not None else (os.environ.get(ENV_VAR) or "auto")
    choice = choice.strip().lower()
    if choice not in ("auto",) + BACKENDS:
        src = "force" if force is not None else ENV_VAR
        raise ValueError(f"{src}={choice!r}: expected one of 'torch', 'triton' or 'auto'")
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise BackendUnavailable(f"triton backend forced but triton does not import ({_triton_error})")
    if dev.type != "cuda" and not interpreter_enabled():
        raise BackendUnavailable(
            f"triton backend forced for {dev.type} tensors: set TRITON_INTERPRET=1 before triton is imported "
            "(the interpreter is slow and meant for tests), or use the torch backend"
        )
    return "triton"


def _impl(family: str, device: torch.device, force: str | None) -> Any:
    """The module implementing family on the chosen backend (triton modules are imported only here)."""
    if get_backend(device, force) == "torch":
        return {"merge": _merge_ref, "paged_decode": _paged_ref, "paged_prefill": _prefill_ref, "quant_kv": _quant_ref,
                "sparse": _sparse_ref}[family]
    sub = {"merge": "merge", "paged_decode": "paged_decode", "paged_prefill": "paged_prefill", "quant_kv": "quant_kv",
           "sparse": "sparse_prefill"}
    return importlib.import_module(f"{__package__}.{sub[family]}.triton")


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, force: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way merge: out_* [..., H, D], lse_* [..., H] natural log -> (out [..., H, D], lse [..., H] fp32)."""
    return _impl("merge", out_a.device, force).merge_states(out_a, lse_a, out_b, lse_b)


def merge_states_n(
    outs: torch.Tensor, lses: torch.Tensor, force: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """N-way merge: outs [S, ..., H, D], lses [S, ..., H] natural log -> (out [..., H, D], lse [..., H] fp32)."""
    return _impl("merge", outs.device, force).merge_states_n(outs, lses)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    return_lse: bool = False,
    check_tables: bool = True,
    force: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode. q [B, Hq, D]; k/v_cache [NB, BS, Hkv, D]; block_tables [B, MB] int32; seq_lens [B] int32.

    Returns out [B, Hq, D] (q.dtype), plus lse [B, Hq] fp32 natural log with return_lse.
    """
    mod = _impl("paged_decode", q.device, force)
    return mod.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, return_lse, check_tables)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    past: int,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    force: str | None = None,
) -> torch.Tensor:
    """Causal prefill of T rows at positions past..past+T-1 over the paged cache. q [T, Hq, D]; k/v_cache
    [NB, BS, Hkv, D] (q's dtype, or int8 / fp8 with k/v_scale [NB, BS, Hkv]); block_table [MB] int32 -> [T, Hq, D]."""
    mod = _impl("paged_prefill", q.device, force)
    return mod.paged_prefill(q, k_cache, v_cache, block_table, past, sm_scale, k_scale, v_scale)


def quant_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str | None = None,
    sm_scale: float | None = None,
    return_lse: bool = False,
    check_tables: bool = True,
    force: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode over an int8 / fp8 / int4 cache with fp16 scales (layouts in quant_kv/reference.py).

    Returns out [B, Hq, D] (q.dtype), plus lse [B, Hq] fp32 natural log with return_lse.
    """
    mod = _impl("quant_kv", q.device, force)
    return mod.quant_paged_decode(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, fmt, sm_scale, return_lse, check_tables
    )


def sparse_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor | None = None,
    block_size: int = 64,
    sm_scale: float | None = None,
    keep_ratio: float = 0.1,
    max_keep_tokens: int | None = _sparse_ref.MAX_KEEP_TOKENS,
    min_tokens: int = _sparse_ref.DENSE_BELOW_TOKENS,
    max_density: float = _sparse_ref.DENSE_ABOVE_DENSITY,
    return_info: bool = False,
    force: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, Any]]:
    """Causal prefill for one sequence, after S - T cached tokens: q [T, H, D] at positions S-T..S-1, k/v [S, Hkv, D]
    (past keys, then the new ones; S == T: a fresh prefill) -> out [T, H, D] in q.dtype.

    With block_mask [H, nQB, nKB] (sparse_prefill/reference.py: blocks at absolute multiples of block_size, bottom-right
    aligned) the block-sparse kernel runs on exactly that mask. Without it the path is chosen: dense SDPA when
    S < min_tokens or T < the reference's DENSE_BELOW_QUERIES; otherwise the vertical-slash estimate (keep_ratio,
    capped at max_keep_tokens; last query block against all S keys) builds a mask and runs sparse unless its density
    exceeds max_density.
    return_info adds {"path", "density", "backend"}.
    """
    backend = get_backend(q.device, force)
    info: dict[str, Any] = {"path": "sparse", "density": None, "backend": backend}
    T, past = q.shape[0], k.shape[0] - q.shape[0]
    if block_mask is None:
        if _sparse_ref.choose_path(T, None, min_tokens, max_density, past) == "dense":
            info["path"] = "dense"
        else:
            block_mask = _sparse_ref.estimate_block_mask(q, k, block_size=block_size, keep_ratio=keep_ratio,
                                                        max_keep_tokens=max_keep_tokens)
            info["density"] = _sparse_ref.block_density(block_mask)
            info["path"] = _sparse_ref.choose_path(T, info["density"], min_tokens, max_density, past)
    if info["path"] == "dense":
        out = _sparse_ref.dense_causal_attention(q, k, v, sm_scale)  # SDPA: flash on CUDA, fused on CPU
    else:
        out = _impl("sparse", q.device, backend).block_sparse_attention(q, k, v, block_mask, block_size, sm_scale)
    return (out, info) if return_info else out
