"""The ranks of a multi-rank cell: one process per rank, started by torch's launcher, rank 0 serving and driving.

    python -m torch.distributed.run --standalone --nproc-per-node N -m modeld_cell serve ...

(the operator's pod command for a multi-rank Cell; ``hack/podrunner`` runs it as local processes.) Every rank loads
the same weights and its own KV pool (``kvMemoryMiB`` per rank). Rank 0 builds the engine: its block manager,
prefix index, scheduler and sessions are rank 0's alone, over a ``ShardedPool`` of global block ids. Every forward
and every K/V operation rank 0's engine runs goes first to the other ranks as one message on a gloo control group
(``DrivingRunner``), then runs on rank 0; the followers (``follow``) run the same operation on their shard. The
forwards meet in the sharded-KV merge (one all-gather per layer); snapshot reads and writes gather and scatter each
rank's part. The followers keep no state besides their KV blocks: the message says everything (tokens, positions,
global block tables).

Timeouts: the data group (the merge's all-gather, the snapshot gathers) waits ``MODELD_COLLECTIVE_TIMEOUT_S`` for
every rank, then fails: rank 0 raises ``RankLost``, the engine turns it into ``fatal`` and reports not ready. The
control group only carries rank 0's messages, and followers wait on it as long as the cell is idle, so its timeout
is long; a rank that dies is seen by torch's launcher, which stops the others and exits non-zero, and the pod's
container restarts all ranks together.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from modeld_cell import errors
from modeld_cell.kernels.merge import sharded

from .sharded_kv import RankLost, ShardedKVRunner

IDLE_TIMEOUT = datetime.timedelta(days=30)      # the control group: followers wait on it while the cell is idle
LAUNCH = "python -m torch.distributed.run --standalone --nproc-per-node {ranks} -m modeld_cell serve"


@dataclass
class Ranks:
    rank: int
    world: int
    backend: str                           # the data group's: gloo (CPU ranks) or nccl
    timeout_s: int
    ctrl: dist.ProcessGroup                # gloo, rank 0's messages


def join(ranks: int, device: str, timeout_s: int) -> Ranks:
    """Join the cell's process group as the launcher started this process (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment). Unsupported, naming the field, when the process was not started so or the world differs from the
    spec's ranks; idempotent within a process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise errors.Unsupported(
            f"runtime.ranks {ranks}: a multi-rank cell runs one process per rank under torch's launcher; start the "
            f"worker as `{LAUNCH.format(ranks=ranks)}` (the operator's pod command does)", field="runtime.ranks")
    world = int(os.environ["WORLD_SIZE"])
    if world != ranks:
        raise errors.Unsupported(f"runtime.ranks {ranks}, but the launcher started {world} processes",
                                 field="runtime.ranks", value=str(ranks))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    assert isinstance(ctrl, dist.ProcessGroup)       # every rank is a member
    return Ranks(dist.get_rank(), world, backend, timeout_s, ctrl)


def assemble(parts: list[list[tuple[str, Tensor]]], n: int, block_size: int) -> list[tuple[str, Tensor]]:
    """The ranks' read_local parts (rank order) back into one payload in token order: [L, n, ...] per name."""
    world = len(parts)
    names = [name for name, _ in parts[0]]
    out = []
    for j, name in enumerate(names):
        pieces, taken = [], [0] * world
        for i in range(-(-n // block_size)):
            r = sharded.owner(i, world)
            m = min(block_size, n - i * block_size)
            pieces.append(parts[r][j][1][:, taken[r] : taken[r] + m])
            taken[r] += m
        out.append((name, torch.cat(pieces, 1) if pieces else parts[0][j][1]))
    return out


def split(payload: dict[str, Tensor], n: int, block_size: int, world: int) -> list[dict[str, Tensor]]:
    """Inverse of assemble: each rank's part of a payload in token order."""
    out: list[dict[str, Tensor]] = []
    for r in range(world):
        idx = [i for i in sharded.local_block_indices(-(-n // block_size), r, world)]
        rows = [t for i in idx for t in range(i * block_size, min(n, (i + 1) * block_size))]
        sel = torch.tensor(rows, dtype=torch.long)
        out.append({name: t.index_select(1, sel.to(t.device)).cpu() for name, t in payload.items()})
    return out


class DrivingRunner(ShardedKVRunner):
    """Rank 0's runner: each operation is sent to the followers, then run here (the torch thread runs them all, one
    at a time, so every rank sees them in the same order)."""

    def __init__(self, model: Any, kv: Any, ranks: Ranks) -> None:
        super().__init__(model, kv)
        self.ranks = ranks
        self.pool: Any = None          # the ShardedPool over every rank's blocks (it sets itself here)

    def _send(self, *op: Any) -> None:
        try:
            dist.broadcast_object_list([op], src=0, group=self.ranks.ctrl)
        except RuntimeError as e:
            raise RankLost(f"rank 0 of {self.world}: sending {op[0]!r} to the other ranks failed: {e}") from e

    def prefill(self, tokens: list[int], start: int, blocks: list[int],
                sparse: dict | None = None) -> tuple[Tensor, float, list[dict]]:
        self._send("prefill", tokens, start, blocks)
        return super().prefill(tokens, start, blocks, sparse)

    def decode(self, toks: list[int], positions: list[int], tables: list[list[int]]) -> Tensor:
        self._send("decode", toks, positions, tables)
        return super().decode(toks, positions, tables)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        self._send("copy", src, dst, n)
        self.copy_local(src, dst, n)

    def read(self, blocks: list[int], n: int) -> list[tuple[str, Tensor]]:
        self._send("read", blocks, n)
        parts: list[Any] = [None] * self.world
        try:
            dist.gather_object(self.read_local(blocks, n), parts, dst=0, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"rank 0 of {self.world}: gathering the ranks' K/V failed: {e}") from e
        return assemble(parts, n, self.kv.block_size)

    def write(self, blocks: list[int], n: int, payload: dict[str, Tensor]) -> None:
        self._send("write", blocks, n)
        parts = split(payload, n, self.kv.block_size, self.world)
        mine: list[Any] = [None]
        try:
            dist.scatter_object_list(mine, parts, src=0, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"rank 0 of {self.world}: sending the ranks' K/V failed: {e}") from e
        self.write_local(blocks, n, mine[0])

    def report(self) -> dict[str, Any]:
        """The capability report's "parallel": the shape, the ranks' KV together and per rank, the layout, and the
        measured time in the merge's collective per forward (rank 0's view)."""
        pool = self.pool
        per_step = {k: (round(self.collective_s[k] / n * 1e3, 3) if (n := self.forwards[k]) else None)
                    for k in ("prefill", "decode")}
        return {"shape": "sharded-kv", "ranks": self.world, "backend": self.ranks.backend,
                "layout": pool.stats()["layout"], "weights": "replicated on every rank",
                "kv_budget_bytes_per_rank": pool.local.budget_bytes, "kv_budget_bytes_total": pool.budget_bytes,
                "max_tokens_per_rank": pool.per_rank_max_tokens, "max_tokens_total": pool.max_tokens,
                "scratch_blocks_per_rank": 1,
                "collective": f"all-gather of [rows, Hq, D + 1] fp32 per layer ({self.model.args.n_layers} layers)",
                "collective_timeout_s": self.ranks.timeout_s,
                "collective_ms_per_forward": per_step,
                "forwards": dict(self.forwards)}

    def stop(self) -> None:
        """Tell the followers to return from ``follow`` (a clean shutdown; a lost rank is the launcher's)."""
        self._send("stop")


def follow(runner: ShardedKVRunner, ranks: Ranks) -> None:
    """A follower's life: run each operation rank 0 sends, on this rank's shard, until "stop". A failed collective
    raises (RankLost) and ends the process; the launcher then stops the other ranks."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ranks.ctrl)
        op, *args = box[0]
        if op == "stop":
            return
        if op == "prefill":
            runner.prefill(*args)
        elif op == "decode":
            runner.decode(*args)
        elif op == "copy":
            runner.copy_local(*args)
        elif op == "read":
            dist.gather_object(runner.read_local(*args), None, dst=0, group=runner.group)
        elif op == "write":
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, None, src=0, group=runner.group)
            runner.write_local(args[0], args[1], mine[0])
        else:
            raise RuntimeError(f"unknown operation from rank 0: {op!r}")
