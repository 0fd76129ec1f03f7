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
from modeld_cell.runner import TorchRunner

from .pipeline import PipelineRunner, keep_layers, layer_split
from .sharded_kv import RankLost, ShardedKVRunner
from .tensor import Collectives, TensorParallelRunner, shard_model

IDLE_TIMEOUT = datetime.timedelta(days=30)      # the control group: followers wait on it while the cell is idle
LAUNCH = "python -m torch.distributed.run --standalone --nproc-per-node {ranks} -m modeld_cell serve"


@dataclass
class Ranks:
    rank: int
    world: int
    backend: str                           # the data group's: gloo (CPU ranks) or nccl
    timeout_s: int
    ctrl: dist.ProcessGroup                # gloo, rank 0's messages


def launched(ranks: int) -> int:
    """This process's rank as torch's launcher started it (RANK, WORLD_SIZE in the environment); Unsupported, naming
    the field, when it was not started so or the world differs from the spec's ranks."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise errors.Unsupported(
            f"runtime.ranks {ranks}: a multi-rank cell runs one process per rank under torch's launcher; start the "
            f"worker as `{LAUNCH.format(ranks=ranks)}` (the operator's pod command does)", field="runtime.ranks")
    world = int(os.environ["WORLD_SIZE"])
    if world != ranks:
        raise errors.Unsupported(f"runtime.ranks {ranks}, but the launcher started {world} processes",
                                 field="runtime.ranks", value=str(ranks))
    return int(os.environ["RANK"])


def join(ranks: int, device: str, timeout_s: int) -> Ranks:
    """Join the cell's process group as the launcher started this process (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment). Unsupported, naming the field, when the process was not started so or the world differs from the
    spec's ranks; idempotent within a process."""
    launched(ranks)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    assert isinstance(ctrl, dist.ProcessGroup)       # every rank is a member
    return Ranks(dist.get_rank(), ranks, backend, timeout_s, ctrl)


class Driving(TorchRunner):
    """Rank 0's side of a rank runner (mixed in before it: ``ShardedDriver``, ``TensorDriver``): each operation is
    sent to the followers, then run here. The torch thread runs them all, one at a time, so every rank sees them in
    the same order. The runner below supplies this rank's part (``copy_local``, ``read_local``, ``write_local``),
    how the ranks' parts join (``assemble``, ``split``) and its section of the report (``shape_report``)."""

    ranks: Ranks
    pool: Any = None                     # the RankPool over every rank's blocks (it sets itself here)
    world: int
    group: Any
    forwards: dict[str, int]
    collective_s: dict[str, float]
    copy_local: Any
    read_local: Any
    write_local: Any
    assemble: Any
    split: Any
    shape_report: Any

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
        return self.assemble(parts, n)

    def write(self, blocks: list[int], n: int, payload: dict[str, Tensor]) -> None:
        self._send("write", blocks, n)
        parts = self.split(payload, n)
        mine: list[Any] = [None]
        try:
            dist.scatter_object_list(mine, parts, src=0, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"rank 0 of {self.world}: sending the ranks' K/V failed: {e}") from e
        self.write_local(blocks, n, mine[0])

    def report(self) -> dict[str, Any]:
        """The capability report's "parallel": the shape's own section, the ranks, the collective's timeout and the
        measured time rank 0 spent in collectives per forward."""
        per_step = {k: (round(self.collective_s[k] / n * 1e3, 3) if (n := self.forwards[k]) else None)
                    for k in ("prefill", "decode")}
        return {"ranks": self.world, "backend": self.ranks.backend, **self.shape_report(self.pool),
                "collective_timeout_s": self.ranks.timeout_s, "collective_ms_per_forward": per_step,
                "collective_ms_total": {k: round(v * 1e3, 3) for k, v in self.collective_s.items()},
                "forwards": dict(self.forwards)}

    def stop(self, send: bool = True) -> None:
        """Tell the followers to return from ``follow`` (a clean shutdown; ``send=False`` after a lost rank, which is
        the launcher's), then leave the groups."""
        try:
            if send and dist.is_initialized():       # not yet left (a second shutdown is a no-op)
                self._send("stop")
        finally:
            leave()


class ShardedDriver(Driving, ShardedKVRunner):
    def __init__(self, model: Any, kv: Any, ranks: Ranks) -> None:
        ShardedKVRunner.__init__(self, model, kv)
        self.ranks = ranks


class TensorDriver(Driving, TensorParallelRunner):
    def __init__(self, model: Any, kv: Any, ranks: Ranks, heads: tuple[range, range], clock: Collectives) -> None:
        TensorParallelRunner.__init__(self, model, kv, heads=heads, clock=clock)
        self.ranks = ranks


class PipelineDriver(Driving, PipelineRunner):
    def __init__(self, model: Any, kv: Any, ranks: Ranks, layers: range) -> None:
        PipelineRunner.__init__(self, model, kv, layers=layers)
        self.ranks = ranks


def rank_runner(cfg: Any, model: Any, rk: Ranks) -> tuple[Any, Any]:
    """This rank's runner and, on rank 0, the engine's pool over every rank's blocks (else None). Tensor parallel
    cuts the model down to this rank's heads first (parallel/tensor.shard_model), pipeline parallel to its layers
    (parallel/pipeline.keep_layers)."""
    from modeld_cell.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, kv_format

    from .pool import MirroredPool, ShardedPool

    a = model.args
    heads, layers = None, None
    n_layers, n_kv = a.n_layers, a.n_kv_heads
    clock = Collectives()
    if cfg.parallelism == "tensor":
        heads = shard_model(model, rk.rank, rk.world, None, clock)
        n_kv = len(heads[1])
    elif cfg.parallelism == "pipeline":
        if rk.world > a.n_layers:
            raise errors.Unsupported(f"runtime.ranks {rk.world}: pipeline parallel gives each rank at least one of "
                                     f"the model's {a.n_layers} layers", field="runtime.ranks", value=str(rk.world))
        layers = layer_split(a.n_layers, rk.world)[rk.rank]
        keep_layers(model, layers, first=rk.rank == 0, last=rk.rank == rk.world - 1)
        n_layers = len(layers)
    local = PagedKVCache(n_layers, n_kv, a.head_dim, kv_format(cfg.kv), cfg.kv_memory_mib << 20, DEFAULT_BLOCK_SIZE,
                         device=cfg.device)
    runner: Any
    if rk.rank != 0:
        if heads is not None:
            return TensorParallelRunner(model, local, heads=heads, clock=clock), None
        if layers is not None:
            return PipelineRunner(model, local, layers=layers), None
        return ShardedKVRunner(model, local), None
    if heads is not None:
        runner = TensorDriver(model, local, rk, heads, clock)
        return runner, MirroredPool(local, rk.world, runner, a.n_layers, a.n_kv_heads)
    if layers is not None:
        runner = PipelineDriver(model, local, rk, layers)
        return runner, MirroredPool(local, rk.world, runner, a.n_layers, a.n_kv_heads)
    runner = ShardedDriver(model, local, rk)
    return runner, ShardedPool(local, rk.world, runner)


def leave() -> None:
    """Destroy this process's groups (idempotent). Every rank does so before it exits: a gloo group left to the
    interpreter's teardown can abort the process from a worker thread still holding tensors (SIGABRT, "terminate
    called without an active exception": pytorch/pytorch#190489), which the launcher reports as a failed rank."""
    if dist.is_initialized():
        dist.destroy_process_group()


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
