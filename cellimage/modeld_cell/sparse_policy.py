"""Which prefill chunks of a block-sparse cell run sparse, and what the trace and the capability report say of it.

A cell with ``profile.attention: block-sparse`` keeps the dense path (kernels/sparse_prefill's choose_path decides
per chunk, the model per layer by the estimated density). This module turns those decisions into the settings a
chunk's forward gets, a record per chunk, and the trace's ``fallback`` when anything ran dense.
"""

from __future__ import annotations

from typing import Any

from .config import SPARSE_BLOCK, EngineSettings
from .kernels.sparse_prefill import reference as sparse_ref


def sparse_settings(st: EngineSettings) -> dict[str, Any]:
    """What a chunk that runs sparse computes with: its forward's settings, and part of a sparse cell's cache
    identity (which chunks run sparse, and how, decides the bits of their K/V)."""
    return {"block_size": SPARSE_BLOCK, "keep_ratio": st.sparse_keep_ratio, "min_tokens": st.sparse_min_tokens,
            "max_density": st.sparse_max_density, "max_keep_tokens": st.sparse_max_keep_tokens}


class SparsePolicy:
    def __init__(self, settings: EngineSettings, n_layers: int, requested: str) -> None:
        self.settings, self.n_layers, self.requested = settings, n_layers, requested
        # prefill chunks by path, and the last chunk's record (capability()["attention"]["sparse"])
        self.stats: dict[str, Any] = {"chunks_sparse": 0, "chunks_dense": 0, "last_chunk": None}

    def meta(self, n_tokens: int, start: int) -> tuple[dict | None, str | None]:
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
        return sparse_settings(st), None

    def record(self, n_tokens: int, start: int, reason: str | None, log: list[dict]) -> dict:
        """The chunk's record from the model's per-layer log ({"path", "density", ...}): {"tokens", "past",
        "layers", "sparse_layers", "densities", "reason"}; counted in ``stats``."""
        ran = [i for i in log if i["path"] == "sparse"]
        dens = [round(i["density"], 4) for i in log if i["density"] is not None]
        if reason is None and len(ran) < self.n_layers:
            reason = (f"estimated block density above {self.settings.sparse_max_density} in "
                      f"{self.n_layers - len(ran)} of {self.n_layers} layers")
        rec = {"tokens": n_tokens, "past": start, "layers": self.n_layers, "sparse_layers": len(ran),
               "densities": dens, "reason": reason}
        self.stats["chunks_sparse" if ran else "chunks_dense"] += 1
        self.stats["last_chunk"] = rec
        return rec

    def fallback(self, att: list[dict]) -> dict | None:
        """The trace's fallback from a request's chunk records: None when every chunk ran sparse in every layer (or
        nothing ran), else what ran and the first reason."""
        if not att:
            return None
        sparse_layers = sum(a["sparse_layers"] for a in att)
        total_layers = sum(a["layers"] for a in att)
        if sparse_layers == total_layers:
            return None
        reason = next(a["reason"] for a in att if a["reason"])
        return {"requested": self.requested,
                "ran": "dense" if sparse_layers == 0 else "block-sparse+dense", "reason": reason,
                "chunks": len(att), "sparse_layers": sparse_layers, "layers": total_layers}
