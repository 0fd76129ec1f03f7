"""What an engine reports about itself: the capability report (GET /v1/capability), prefix reuse's part of it, and
the counters behind /metrics. Read-only views of the engine's parts; nothing here changes state."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from modeld_api.served import not_served

from . import __version__
from .kernels.sparse_prefill import reference as sparse_ref
from .model import ROW_TILE
from .prefix_index import IDENTITY_KEY_FIELDS
from .quantize import weights_bytes as served_weights_bytes
from .snapshot import SNAPSHOT_VERSION

if TYPE_CHECKING:
    from .engine import Engine

# What the engine refuses beyond the spec values modeld_api.served refuses (a model property, checked at load).
ENGINE_UNSUPPORTED = ("sliding-window attention: a contextTier above the model's window is refused",)


def unsupported() -> list[str]:
    """Exactly the modes this worker does not serve: the spec values modeld_api.served refuses, then the engine's."""
    return [*not_served(), *ENGINE_UNSUPPORTED]


def capability(e: Engine) -> dict:
    from .engine import SPARSE_BLOCK

    a = e.model.args
    kernels = e.runner.kernels()
    kvs = e.kv.stats()
    weights_bytes = served_weights_bytes(e.model)
    rss = None
    try:
        with open("/proc/self/status") as f:
            rss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
        pass
    return {
        "context_tier": e.context_tier,
        "model_max_context": a.max_seq_len,
        "model_trained_context": a.trained_max_seq_len or a.max_seq_len,
        "rope_scaling": a.rope_scaling,
        "kv": {"precision": e.kv.fmt.name, "storage": str(e.kv.fmt.storage).removeprefix("torch."),
               "scales": e.kv.fmt.scales,
               "block_size": e.kv.block_size,
               "bytes_per_token": e.kv.bytes_per_token, "budget_bytes": e.kv.budget_bytes,
               "max_tokens_in_budget": e.kv.max_tokens, "num_blocks": kvs["num_blocks"],
               "free_blocks": kvs["free_blocks"], "usage_ratio": kvs["usage_ratio"],
               "full_context_sessions": e.kv.max_tokens // e.context_tier},
        "parallel": parallel_report(e),
        "memory": {"weights_bytes": weights_bytes, "kv_budget_bytes": e.kv.budget_bytes, "rss_bytes": rss},
        "runtime": {"backend": e.identity["backend"], "version": __version__, "torch": torch.__version__,
                    "device": str(e.kv.device), "device_name": device_name(e.kv.device),
                    "runner": e.runner.name, "startup_check": e.startup, "threads": torch.get_num_threads(),
                    "decode_threads": getattr(e.runner, "decode_threads_report", None),
                    "decode_step": getattr(e.runner, "decode_step_report", None),
                    "decoded_kv": getattr(e.runner, "decoded_kv_report", None),
                    # the prefill attention chosen for the model (runner.choose_row_attention) and whether this
                    # engine's pool takes it
                    "prefill_attention": {**(getattr(e.model, "row_attention_report", None) or {}),
                                          "serves_this_pool": getattr(e.runner, "rows_attention", None) is not None},
                    "weights_dtype": e.config.weights, "weights_requested": e.config.weights_storage,
                    "weights_kernel": e.config.weights_kernel, "weights_choice": e.config.weights_choice,
                    "weights_layout": e.identity.get("weights_kernel"),       # as held: e.g. "dense; oneDNN-packed: 120"
                    "weights_pack_refused": getattr(e.model, "pack_refused", None),
                    # plain weights measured faster for the layer step, packed instead: their rows were not invariant
                    "weights_plain_refused": getattr(e.model, "plain_refused", None),
                    # the packed weights multiply fixed row tiles because untiled they were not row-invariant here
                    "weights_row_tile": ({"rows": ROW_TILE, "reason": why}
                                         if (why := getattr(e.model, "row_tile_reason", None)) else None),
                    "prefill_chunk": e.settings.prefill_chunk,
                    "max_decode_batch": e.settings.max_decode_batch},
        "model": {"name": e.identity["model_name"], "family": e.identity["model_family"],
                  "format": e.identity["model_format"], "digest": e.identity["model_digest"],
                  "source_sha256": e.identity["source_sha256"], "params": e.identity["params"],
                  "architecture": a.arch, "layers": a.n_layers, "hidden": a.dim, "heads": a.n_heads,
                  "kv_heads": a.n_kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab_size,
                  "tokenizer_hash": e.identity["tokenizer_hash"],
                  "template_hash": e.identity["template_hash"],
                  "adapter": e.identity.get("adapter") or None},
        "attention": {"mode": "block-sparse" if e.sparse else "dense",
                      "requested": e.config.attention_requested,
                      "prefill": kernels["prefill"],
                      "decode": kernels["decode"],
                      "kernels": kernels,
                      "sparse": {"block_size": SPARSE_BLOCK, "min_tokens": e.settings.sparse_min_tokens,
                                 "max_density": e.settings.sparse_max_density,
                                 "keep_ratio": e.settings.sparse_keep_ratio,
                                 "max_keep_tokens": e.settings.sparse_max_keep_tokens,
                                 "scope": (f"one chunk per prefill with >= min_tokens keys (past + new) and >= "
                                           f"{sparse_ref.DENSE_BELOW_QUERIES} new tokens, fresh or after cached "
                                           "tokens"),
                                 **e.sparse_stats}
                      if e.sparse else None},
        "prefix_reuse": "cross-session" if e.config.prefix_reuse else "off",
        "reuse": reuse_report(e),
        "snapshot": {"version": SNAPSHOT_VERSION, "supported": True},
        "sampling": {"greedy": True, "temperature": [0, 10], "top_p": "(0, 1]", "top_k": [0, a.vocab_size],
                     "seed": True, "stop_strings": True},
        "quality": {"gated": [v["profile"] for v in e.quality],
                    "reference": "the same weights with fp32 KV and dense attention",
                    "verdicts": e.quality},
        "unsupported": unsupported(),
        "ready": e.ready,
    }

def parallel_report(e: Engine) -> dict:
    """The cell's shape: a multi-rank runner reports its own; a data-parallel copy says which it is."""
    if hasattr(e.runner, "report"):
        return e.runner.report()
    c = e.config
    if c.parallelism == "data":
        return {"shape": "data", "copies": c.ranks, "copy": c.copy,
                "sessions": "each copy serves its own sessions from its own KV pool, on spec.port + copy; the "
                            "operator binds each Session to one copy",
                "max_tokens_per_copy": e.kv.max_tokens,
                "certification": "one copy is measured: the copies add sessions served, never a single-session gain"}
    return {"shape": c.parallelism, "ranks": c.ranks}


@functools.cache
def device_name(dev: torch.device) -> str:
    """The device in words: the GPU's product name, or the CPU's model name (profile_gate.hardware's; read once).
    Imported when called: profile_gate -> quality -> engine -> capability."""
    from .profile_gate import hardware

    return str(hardware(dev)["name"] or dev.type)


def reuse_report(e: Engine) -> dict:
    """Prefix reuse as the capability report shows it."""
    idx = e.kv.index
    return {"enabled": e.config.prefix_reuse,
            "scope": "cross-session" if e.config.prefix_reuse else "off",
            "block_size": e.kv.block_size, "cached_blocks": len(idx),
            "cached_tokens": len(idx) * e.kv.block_size, "evictable_blocks": idx.evictable,
            "evictions": idx.evictions, "identity_key_fields": list(IDENTITY_KEY_FIELDS),
            "identity_root": e._root.hex(), "eviction": "LRU over unreferenced cached blocks",
            "exactness": reuse_exactness(e),
            "exactness_probe": e.model.chunking_probe or "passed: rows are invariant on this CPU's kernels",
            # "exact": a decoded token's K/V are a prefill's bits; "recomputed": a one-session step's are not, and
            # the tokens are computed again before anything is appended after them (runtime.decoded_kv has why)
            "decoded_tokens": ("recomputed before reuse" if getattr(e.runner, "decoded_kv", "exact") == "recompute"
                               else "exact"),
            "prefill_tok_s_measured": round(r, 1) if (r := e._prefill_rate()) else None,
            "cache_scopes": "cache_salt: a new session's blocks are shared only within its salt's scope",
            # MODELD_SESSION_STORE (journal.py): None when off
            "session_store": ({**e.journal.stats(), "errors": e._journal_errors, "commits_at": "every completed "
                               "prefix, suffix and decode", "holds": "tokens and totals; KV recomputed on recovery"}
                              if e.journal is not None else None)}

def reuse_exactness(e: Engine) -> str:
    """'bitwise' when this engine's attention and matmuls are chunking-invariant (the CPU torch path: reused,
    branched, restored or decoded K/V are the bits a cold prefill computes; docs/reuse.md) AND the probe measured
    it on this CPU's kernels (model.probe_chunking_invariance), else 'tolerance'."""
    if (e.runner.chunking_invariant and not e.sparse and e.settings.decode_attention != "dispatch"
            and e.model.chunking_probe is None):
        return "bitwise"
    return "tolerance"

def sessions(e: Engine) -> list[dict]:
    """GET /v1/sessions: each session's tokens, KV blocks (shared ones too), state and totals."""
    return [{"session_id": s.id, "tokens": len(s.tokens), "kv_tokens": s.kv_len, "kv_blocks": len(s.blocks),
             "kv_blocks_shared": sum(1 for b in s.blocks if e.kv.ref[b] > 1),
             "kv_bytes": len(s.blocks) * e.kv.block_bytes, "busy": s.busy, "created": s.created,
             "kv_exact_tokens": s.exact_len,
             "last_used": s.last_used, "totals": dict(s.totals)} for s in e._sessions.values()]


def metrics(e: Engine) -> dict:
    running = len(e.scheduler.reqs) + e._running_prefills
    return {
        "num_requests_running": running,
        "num_requests_waiting": max(0, len(e.scheduler.reqs) - e.settings.max_decode_batch),
        "kv_cache_usage_perc": e.kv.usage_ratio,
        "sessions": len(e._sessions),
        **e._counters,
        "prefix_cache_evictions": e.kv.index.evictions,
        "prefix_cache_blocks": len(e.kv.index),
        "prefix_cache_evictable_blocks": e.kv.index.evictable,
        "errors_total": dict(e._errors),
        "ready": e.ready,
        "cache_config_info": {"block_size": e.kv.block_size, "num_blocks": e.kv.num_blocks,
                              "kv_dtype": e.kv.fmt.name, "context_tier": e.context_tier},
    }
