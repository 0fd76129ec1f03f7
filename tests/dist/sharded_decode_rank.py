"""One rank of the sharded-KV decode check, started by torch's launcher (tests/kernels/test_sharded_merge.py):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/dist/sharded_decode_rank.py OUT.json

Every rank builds the same paged cache from one seed, keeps only its round-robin shard of each sequence's blocks,
runs the paged decode over that shard (out, lse), and merges across ranks. Rank 0 also runs the decode over the
whole cache and writes both results' max-abs difference, and whether every rank's merged bytes are identical.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys

import torch
import torch.distributed as dist

from modeld_cell.kernels.merge import sharded
from modeld_cell.kernels.paged_decode import reference as paged_ref


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    BS, Hq, Hkv, D = 16, 9, 3, 64
    lens = [1, 16, 17, 33, 100, 257]          # one token; a page; across page and shard boundaries; longer
    B, MB = len(lens), max(-(-n // BS) for n in lens)
    NB = B * MB + 4
    kc, vc = torch.randn(NB, BS, Hkv, D, generator=g), torch.randn(NB, BS, Hkv, D, generator=g)
    perm = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).to(torch.int32)
    q = torch.randn(B, Hq, D, generator=g)
    seq = torch.tensor(lens, dtype=torch.int32)
    # this rank's shard: its blocks of each sequence, in order, and how many of the tokens they hold
    local_bt = torch.zeros(B, MB, dtype=torch.int32)
    local_len = []
    for b, n in enumerate(lens):
        idx = sharded.local_block_indices(-(-n // BS), rank, world)
        local_bt[b, : len(idx)] = perm[b, idx]
        local_len.append(sharded.local_tokens(n, BS, rank, world))
    # a shard's last block is partial only when it holds the sequence's tail; the tail is then its last block
    out, lse = paged_ref.paged_decode(q, kc, vc, local_bt, torch.tensor(local_len, dtype=torch.int32),
                                      return_lse=True)
    merged, merged_lse = sharded.merge_across_ranks(out, lse)
    digests = [None] * world
    digest = hashlib.sha256(merged.numpy().tobytes() + merged_lse.numpy().tobytes()).hexdigest()
    dist.all_gather_object(digests, digest)
    if rank == 0:
        want, want_lse = paged_ref.paged_decode(q, kc, vc, perm, seq, return_lse=True)
        res = {"world": world, "layout": sharded.LAYOUT, "lens": lens, "local_lens_rank0": local_len,
               "max_abs_out": float((merged - want).abs().max()), "max_abs_lse": float((merged_lse - want_lse).abs().max()),
               "identical_on_every_rank": len(set(digests)) == 1}
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
