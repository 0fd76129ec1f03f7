"""Two sharded-KV ranks decode; rank 1 dies after a few steps (tests/cell/test_sharded_kv.py starts it):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/sharded_rank_lost.py GGUF TIMEOUT_S die|hang OUT

``die``: rank 1 leaves with os._exit(0) (as a killed process would, without telling anyone; exit 0 keeps torch's
launcher from tearing rank 0 down first). ``hang``: rank 1 stops answering (sleeps past the timeout). Either way
rank 0 must get a typed error from its next collective within the group's timeout, not hang; it writes the error's
type, message and how long it took.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.models import build_model, load_checkpoint
from modeld_cell.parallel.sharded_kv import RankLost, ShardedKVRunner, global_id


def main() -> None:
    path, timeout_s, mode, out_path = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model, _, _ = build_model(load_checkpoint(path), torch.float32, layers=1, use_digest_cache=False)
    a = model.args
    kv = PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, kv_format("fp32"), 4 << 20)
    world = dist.get_world_size()
    table = [global_id(1 + i // world, i % world, world) for i in range((kv.num_blocks - 1) * world)]
    runner = ShardedKVRunner(model, kv)
    seq = [(i * 7919 + 11) % a.vocab_size for i in range(40)]
    logits = runner.prefill(seq, 0, table[: kv.blocks_for(len(seq))])[0]
    res: dict = {"command": "python -m torch.distributed.run --standalone --nproc-per-node 2 " + " ".join(sys.argv),
                 "steps": 0}
    t0 = time.monotonic()
    try:
        for step in range(20):
            if rank == 1 and step == 3:
                if mode == "hang":
                    time.sleep(timeout_s + 5)
                os._exit(0)
            seq.append(int(logits.argmax()))
            t0 = time.monotonic()
            logits = runner.decode([seq[-1]], [len(seq) - 1], [table[: kv.blocks_for(len(seq))]])[0]
            res["steps"] = step + 1
    except RankLost as e:
        res.update(error=type(e).__name__, message=str(e)[:300], seconds=round(time.monotonic() - t0, 2))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    os._exit(0)      # the group is broken: no barrier or destroy can complete


if __name__ == "__main__":
    main()
