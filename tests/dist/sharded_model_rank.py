"""One rank of the sharded-KV model check on the real SmolLM2 weights (tests/cell/test_sharded_kv.py starts it):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist/sharded_model_rank.py GGUF LAYERS KV STEPS OUT

Every rank builds the same model (the first LAYERS layers), holds its round-robin shard of the session's KV in its
own pool, and runs: a 40-token prefill, a 17-token chunk after that cached past, then STEPS greedy decode steps. Rank 0
also runs the same on one rank's torch path and writes the logits' max abs difference and both token lists.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

from modeld_cell.kv_cache import PagedKVCache, kv_format
from modeld_cell.models import build_model, load_checkpoint
from modeld_cell.parallel.sharded_kv import ShardedKVRunner, global_id
from modeld_cell.runner import TorchRunner


def run(runner, tables_of, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill in two chunks, then greedy decode; returns (logits after each step, generated tokens)."""
    logits, toks = [], []
    for start, end in ((0, 40), (40, len(prompt))):
        lg, _, _ = runner.prefill(prompt[start:end], start, tables_of(end))
        logits.append(lg.float())
    seq = list(prompt)
    for _ in range(steps):
        t = int(logits[-1].argmax())
        toks.append(t)
        seq.append(t)
        lg = runner.decode([t], [len(seq) - 1], [tables_of(len(seq))])[0]
        logits.append(lg.float())
    return logits, toks


def main() -> None:
    path, layers, kv_name, steps, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ckpt = load_checkpoint(path)
    model, _, _ = build_model(ckpt, torch.float32, layers=layers, use_digest_cache=False)
    a = model.args
    fmt = kv_format(kv_name)

    def pool() -> PagedKVCache:
        return PagedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, fmt, 8 << 20)

    kv = pool()
    # the session's block i on rank i % world, local ids from 1 (local 0 is the scratch block, sharded_kv.SCRATCH)
    table = [global_id(1 + i // world, i % world, world) for i in range((kv.num_blocks - 1) * world)]
    runner = ShardedKVRunner(model, kv)
    prompt = [(i * 7919 + 11) % a.vocab_size for i in range(57)]          # crosses pages and shards
    logits, toks = run(runner, lambda n: table[: kv.blocks_for(n)], prompt, steps)
    if rank == 0:
        ref_kv = pool()
        blocks = ref_kv.allocate(ref_kv.num_blocks)
        want, want_toks = run(TorchRunner(model, ref_kv), lambda n: blocks[: ref_kv.blocks_for(n)], prompt, steps)
        res = {"command": f"python -m torch.distributed.run --standalone --nproc-per-node {world} "
                          + " ".join(sys.argv), "world": world, "layers": layers, "kv": kv_name, "tokens": toks, "reference_tokens": want_toks,
               "max_abs_logits": max(float((x - y).abs().max()) for x, y in zip(logits, want, strict=True))}
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
