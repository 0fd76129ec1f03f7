"""Pipeline parallel: each rank holds a contiguous range of the layers; a forward's activations go rank to rank.

Rank 0 embeds the tokens and runs its layers; each next rank receives the hidden state ``[rows, dim]`` from the one
before, runs its layers and sends it on; the last rank applies the final norm and the LM head and sends the logits
back to rank 0, which samples. Every layer runs exactly the computation one rank would, in the same order, so the
logits equal one rank's bit for bit (no sum is split). Each rank's KV pool holds its layers of every block, with the
same block ids everywhere (parallel/pool.MirroredPool on rank 0).

The cost for one interactive session is the bubble: a forward visits the ranks one after another, so while one
computes the others wait; with N ranks each is idle (N - 1) / N of a single session's forward. What the shape buys
is memory (each rank holds 1/N of the weights and of the KV), not speed for one session. Rank 0 measures both parts
of its wait per forward: the bubble (the other ranks' compute, which each message carries along) and the transfers
(the rest of the wait: the communication), in the capability report's ``bubble_ms_per_forward`` and
``collective_ms_per_forward``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from modeld_cell.kv_cache import PagedKVCache
from modeld_cell.model import AttnMetadata, Transformer, rope_rows

from .pool import MirroredLocal
from .sharded_kv import RankLost, RankRunner


def layer_split(n_layers: int, ranks: int) -> list[range]:
    """Contiguous layer ranges, as even as they go (the first ``n_layers % ranks`` ranks get one more)."""
    base, extra = divmod(n_layers, ranks)
    out, start = [], 0
    for r in range(ranks):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def keep_layers(model: Transformer, layers: range, first: bool, last: bool) -> None:
    """Cut the loaded model down to ``layers`` in place, renumbered from 0 for this rank's KV pool; drop the
    embedding unless first (tied to the LM head, it stays on the last rank too), the norm and LM head unless last.
    ``model.args`` keeps the whole model's shape (the cache identity and the snapshot layout are the model's)."""
    kept = [model.layers[i] for i in layers]
    for local, block in enumerate(kept):
        att: Any = block.attention
        att.layer = local
    model.layers = nn.ModuleList(kept)
    if not last:
        model.output = None            # type: ignore[assignment]
        model.norm = None              # type: ignore[assignment]
    if not first and not (last and model.args.tie_embeddings):
        model.tok_embeddings = None    # type: ignore[assignment]


class PipelineRunner(MirroredLocal, RankRunner):
    name = "pipeline"

    def __init__(self, model: Transformer, kv: PagedKVCache, group: dist.ProcessGroup | None = None,
                 layers: range | None = None) -> None:
        super().__init__(model, kv, group)
        self.layers = layers if layers is not None else range(model.args.n_layers)
        self.decode_kernel = f"torch (model.paged_attention) on layers {self.layers.start}-{self.layers.stop - 1}"
        self.attend = None
        self.bubble_s = {"prefill": 0.0, "decode": 0.0}    # rank 0: waiting for the other ranks' compute

    def choose_decode_kernel(self, mode: str) -> None:
        """model.py's torch paths on this rank's layers (MODELD_DECODE_ATTENTION does not apply)."""

    def kernels(self) -> dict[str, str]:
        return {"prefill": f"torch on layers {self.layers.start}-{self.layers.stop - 1} of {self.model.args.n_layers}",
                "decode": self.decode_kernel, "device": str(self.kv.device)}

    def _p2p(self, kind: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args, group=self.group)
        except RuntimeError as e:      # gloo / NCCL: peer gone, connection reset, or the group's timeout
            raise RankLost(f"rank {self.rank} of {self.world}: the pipeline's send/recv failed: {e}") from e
        self.collective_s[kind] += time.perf_counter() - t0

    @torch.inference_mode()
    def _stage(self, tokens: Tensor, positions: Tensor, meta: AttnMetadata, rows: Tensor | None) -> Tensor | None:
        """This rank's part of one forward; rank 0 gets the logits [rows or N, V] fp32 back, the others None.

        Every message carries one trailing element: the seconds the ranks after rank 0 have computed so far in this
        forward (each adds its own). Rank 0 waits for the pipe from its send to the logits' arrival; that wait less the
        others' compute is the transfers (``collective_s``, the communication), the rest is the bubble
        (``bubble_s``): one session's forward visiting the ranks in turn."""
        m = self.model
        k = "decode" if meta.kind == "decode" else "prefill"
        dev = tokens.device
        first, last = self.rank == 0, self.rank == self.world - 1
        n_rows = rows.shape[0] if rows is not None else tokens.shape[0]
        if first:
            x = m.tok_embeddings(tokens)
            busy = 0.0
        else:
            msg = torch.empty(tokens.shape[0] * m.args.dim + 1, dtype=self._dtype(), device=dev)
            self._p2p(k, dist.recv, msg, self.rank - 1)
            t_busy = time.perf_counter()
            x, busy = msg[:-1].view(tokens.shape[0], m.args.dim), float(msg[-1])
        cos, sin = rope_rows(m.rope_cos[positions], m.rope_sin[positions])
        for layer in m.layers:
            x = layer(x, cos, sin, self.kv, meta)
        if not last:
            if first:
                t_pipe = time.perf_counter()           # the wait starts when rank 0's own layers are done
            else:
                busy += time.perf_counter() - t_busy
            out = torch.cat([x.reshape(-1), x.new_tensor([busy])])
            self._p2p(k, dist.send, out, self.rank + 1)
        else:
            if rows is not None:
                x = x[rows]
            logits = m.logits(x)
            if first:
                return logits
            busy += time.perf_counter() - t_busy
            self._p2p(k, dist.send, torch.cat([logits.reshape(-1), logits.new_tensor([busy])]), 0)
            return None
        if first:
            msg = torch.empty(n_rows * m.args.vocab_size + 1, dtype=torch.float32, device=dev)
            self._p2p(k, dist.recv, msg, self.world - 1)
            waited = time.perf_counter() - t_pipe
            others = min(float(msg[-1]), waited)
            # the p2p clock above counted the whole wait; keep only the transfers there, the rest is the bubble
            self.collective_s[k] -= others
            self.bubble_s[k] += others
            return msg[:-1].view(n_rows, m.args.vocab_size)
        return None

    def _dtype(self) -> torch.dtype:
        return next(p for p in self.model.parameters()).dtype

    def forward(self, tokens: Tensor, positions: Tensor, meta: AttnMetadata, rows: Tensor | None = None) -> Tensor:
        kind = "decode" if meta.kind == "decode" else "prefill"
        self.forwards[kind] += 1
        out = self._stage(tokens, positions, meta, rows)
        # a follower's result is never read (rank 0 samples): an empty row per requested row keeps the callers' shape
        return out if out is not None else torch.empty(rows.shape[0] if rows is not None else tokens.shape[0], 0)

    # ---- how the ranks' parts of a payload join (this rank's part: pool.MirroredLocal)

    def assemble(self, parts: list[list[tuple[str, Tensor]]], n: int) -> list[tuple[str, Tensor]]:
        """The ranks' parts (their layers, in rank order) into the whole model's payload [L, n, ...]."""
        return [(name, torch.cat([p[j][1] for p in parts], 0)) for j, (name, _) in enumerate(parts[0])]

    def split(self, payload: dict[str, Tensor], n: int) -> list[dict[str, Tensor]]:
        return [{name: t[r.start : r.stop].cpu() for name, t in payload.items()}
                for r in layer_split(self.model.args.n_layers, self.world)]

    def shape_report(self, pool: Any) -> dict[str, Any]:
        splits = layer_split(self.model.args.n_layers, self.world)
        return {"shape": "pipeline", "weights": f"layers split over {self.world} ranks: "
                + ", ".join(f"{r.start}-{r.stop - 1}" for r in splits),
                "kv_budget_bytes_per_rank": pool.local.budget_bytes, "kv_budget_bytes_total": pool.budget_bytes,
                "max_tokens_total": pool.max_tokens,
                "collective": "send/recv of [rows, dim] between consecutive ranks, the logits back to rank 0",
                "bubble_ms_per_forward": {k: (round(self.bubble_s[k] / n * 1e3, 3) if (n := self.forwards[k]) else None)
                                          for k in ("prefill", "decode")},
                "bubble_ms_total": {k: round(v * 1e3, 3) for k, v in self.bubble_s.items()},
                "bubble": f"one session's forward visits the ranks in turn: each idles {self.world - 1}/{self.world}"
                          " of it"}
