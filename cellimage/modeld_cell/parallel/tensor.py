"""Tensor parallel: each rank holds a slice of every layer's attention heads and MLP, and the row-split halves of a
block (attention's output projection, the MLP's down projection) are summed across ranks.

Split (``head_split``): each rank gets whole GQA groups, so its query heads read only its own KV heads. When the
degree divides the KV heads, each rank holds ``n_kv_heads / ranks`` of them with their query heads; when it is a
multiple of the KV heads whose ratio divides the group size, each KV head is replicated on ``ranks / n_kv_heads``
ranks, each holding an equal share of its query heads (vLLM replicates KV heads the same way when the degree
exceeds them). Anything else is refused, naming runtime.ranks. The MLP's intermediate size must divide evenly.
Embeddings, norms and the LM head are replicated: every rank computes the same logits; rank 0 samples.

The reduction is one all-gather of the partial output per half-block, summed in rank order in fp32 on every rank:
the same bytes everywhere, whatever the collective's own reduction order would be. Each rank's KV pool holds its
KV heads of every block; block ids are the same on every rank (parallel/pool.MirroredPool on rank 0).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from modeld_cell import errors
from modeld_cell.kv_cache import PagedKVCache
from modeld_cell.model import Transformer

from .pool import MirroredLocal
from .sharded_kv import RankLost, RankRunner


def head_split(n_heads: int, n_kv_heads: int, ranks: int) -> list[tuple[range, range]]:
    """Per rank: (its query heads, its KV heads), whole GQA groups each; Unsupported naming runtime.ranks when the
    model's heads do not split so."""
    group = n_heads // n_kv_heads
    if n_kv_heads % ranks == 0:
        kv = n_kv_heads // ranks
        return [(range(r * kv * group, (r + 1) * kv * group), range(r * kv, (r + 1) * kv)) for r in range(ranks)]
    if ranks % n_kv_heads == 0 and group % (ranks // n_kv_heads) == 0:
        share = ranks // n_kv_heads                          # ranks holding a copy of one KV head
        q = group // share
        return [(range(r * q, (r + 1) * q), range(r // share, r // share + 1)) for r in range(ranks)]
    raise errors.Unsupported(
        f"runtime.ranks {ranks}: tensor parallel gives each rank whole GQA groups, and the model's {n_kv_heads} KV "
        f"heads ({n_heads} query heads) split neither evenly over {ranks} ranks nor by replicating each KV head on "
        f"an equal number of them; use a degree dividing {n_kv_heads}, or a multiple of it that divides "
        f"{n_heads}, or runtime.parallelism sharded-kv", field="runtime.ranks", value=str(ranks))


class Collectives:
    """Time spent in the reductions, per forward kind (the capability report's communication cost)."""

    def __init__(self) -> None:
        self.kind = "prefill"
        self.s = {"prefill": 0.0, "decode": 0.0}


class RankSum(nn.Module):
    """A row-split linear: this rank's partial product, then the ranks' partials summed in rank order."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None, clock: Collectives) -> None:
        super().__init__()
        self.inner, self.group, self.clock = inner, group, clock
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def forward(self, x: Tensor) -> Tensor:
        part = self.inner(x).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)]
        t0 = time.perf_counter()
        try:
            dist.all_gather(parts, part, group=self.group)
        except RuntimeError as e:      # gloo / NCCL: peer gone, connection reset, or the group's timeout
            raise RankLost(f"rank {self.rank} of {self.world}: the tensor-parallel reduction failed: {e}") from e
        self.clock.s[self.clock.kind] += time.perf_counter() - t0
        return torch.stack(parts).float().sum(0).to(part.dtype)


def _keep(linear: nn.Linear, rows: Tensor | None = None, cols: slice | None = None) -> None:
    """Keep only ``rows`` of the weight (and bias), or its columns ``cols``."""
    w = linear.weight.data
    w = w.index_select(0, rows.to(w.device)) if rows is not None else w[:, cols]
    linear.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    if rows is not None and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, rows.to(w.device)).contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape


def shard_model(model: Transformer, rank: int, ranks: int, group: dist.ProcessGroup | None,
                clock: Collectives) -> tuple[range, range]:
    """Cut the loaded model down to this rank's heads and MLP slice, in place; returns (query heads, KV heads).
    ``model.args`` keeps the whole model's shape (the cache identity and the snapshot layout are the model's)."""
    a = model.args
    qh, kvh = head_split(a.n_heads, a.n_kv_heads, ranks)[rank]
    if a.intermediate_size % ranks:
        raise errors.Unsupported(f"runtime.ranks {ranks}: the model's MLP ({a.intermediate_size}) does not split "
                                 "evenly", field="runtime.ranks", value=str(ranks))
    d, part = a.head_dim, a.intermediate_size // ranks
    k0, v0 = a.n_heads * d, (a.n_heads + a.n_kv_heads) * d
    qkv_rows = torch.cat([torch.arange(qh.start * d, qh.stop * d), torch.arange(k0 + kvh.start * d, k0 + kvh.stop * d),
                          torch.arange(v0 + kvh.start * d, v0 + kvh.stop * d)])
    mlp = slice(rank * part, (rank + 1) * part)
    w13_rows = torch.cat([torch.arange(mlp.start, mlp.stop),
                          torch.arange(a.intermediate_size + mlp.start, a.intermediate_size + mlp.stop)])
    for layer in model.layers:
        att: Any = layer.attention
        ff: Any = layer.feed_forward
        _keep(att.wqkv, rows=qkv_rows)
        _keep(att.wo, cols=slice(qh.start * d, qh.stop * d))
        att.n_heads, att.n_kv_heads = len(qh), len(kvh)
        att.wo = RankSum(att.wo, group, clock)
        _keep(ff.w13, rows=w13_rows)
        _keep(ff.w2, cols=mlp)
        ff.inter = part
        ff.w2 = RankSum(ff.w2, group, clock)
    return qh, kvh


class TensorParallelRunner(MirroredLocal, RankRunner):
    name = "tensor"

    def __init__(self, model: Transformer, kv: PagedKVCache, group: dist.ProcessGroup | None = None,
                 heads: tuple[range, range] | None = None, clock: Collectives | None = None) -> None:
        super().__init__(model, kv, group)
        self.heads = heads or (range(model.args.n_heads), range(model.args.n_kv_heads))
        self.clock = clock or Collectives()
        self.collective_s = self.clock.s          # the reductions (RankSum) add to it

    def kernels(self) -> dict[str, str]:
        out = super().kernels()
        note = f"; heads {self.heads[0].start}-{self.heads[0].stop - 1} of {self.model.args.n_heads} on this rank"
        return {**out, "prefill": out["prefill"] + note, "decode": out["decode"] + note}

    def prefill(self, tokens: list[int], start: int, blocks: list[int],
                sparse: dict | None = None) -> tuple[Tensor, float, list[dict]]:
        self.forwards["prefill"] += 1
        self.clock.kind = "prefill"
        return super().prefill(tokens, start, blocks, sparse)

    def decode(self, toks: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        self.forwards["decode"] += 1
        self.clock.kind = "decode"
        return super().decode(toks, positions, tables)

    # ---- how the ranks' parts of a payload join (this rank's part: pool.MirroredLocal)

    def assemble(self, parts: list[list[tuple[str, Tensor]]], n: int) -> list[tuple[str, Tensor]]:
        """The ranks' parts (their KV heads) into the whole model's payload: [L, n, Hkv, ...], each KV head taken
        from the first rank holding it."""
        splits = head_split(self.model.args.n_heads, self.model.args.n_kv_heads, self.world)
        first = {h: r for r in reversed(range(self.world)) for h in splits[r][1]}
        out = []
        for j, (name, _) in enumerate(parts[0]):
            heads = []
            for h in range(self.model.args.n_kv_heads):
                r = first[h]
                heads.append(parts[r][j][1][:, :, h - splits[r][1].start])
            out.append((name, torch.stack(heads, 2)))
        return out

    def split(self, payload: dict[str, Tensor], n: int) -> list[dict[str, Tensor]]:
        splits = head_split(self.model.args.n_heads, self.model.args.n_kv_heads, self.world)
        return [{name: t[:, :, kvh.start : kvh.stop].cpu() for name, t in payload.items()} for _, kvh in splits]

    def shape_report(self, pool: Any) -> dict[str, Any]:
        qh, kvh = self.heads
        return {"shape": "tensor", "weights": f"attention heads and MLP split over {self.world} ranks; embeddings, "
                                              "norms and LM head replicated",
                "heads_rank0": {"query": [qh.start, qh.stop - 1], "kv": [kvh.start, kvh.stop - 1]},
                "kv_heads_per_rank": len(kvh), "kv_budget_bytes_per_rank": pool.local.budget_bytes,
                "kv_budget_bytes_total": pool.budget_bytes, "max_tokens_total": pool.max_tokens,
                "collective": f"all-gather of [rows, {self.model.args.dim}] per half-block, summed in rank order "
                              f"(2 per layer, {self.model.args.n_layers} layers)"}
