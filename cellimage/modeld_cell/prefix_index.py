"""Content-addressed prefix index over full KV blocks: block-hash chains, shared by all sessions of a cell.

A full block (BLOCK_SIZE tokens whose K/V are computed) is named by a chain hash:

    h_0 = root = blake2b(canonical JSON of the cache identity)     # model digest, backend+version, quant, KV, ...
    h_i = blake2b(h_{i-1} || token ids of block i as u32 LE)       # 16-byte digests

so a hash names the whole prefix up to the end of its block *and* the identity that computed it: blocks of another
model, backend version, quant/KV profile, adapter, tokenizer, template or manifest can never match (their root
differs). Partial blocks are never indexed; a mid-block divergence is served by copying the matching head of a
candidate block (copy-on-write, see ``children``).

The index only names blocks; refcounts and the free list are the cache's (``kv_cache.PagedKVCache``). A registered
block whose refcount drops to 0 is *evictable*: it stays here, in LRU order, until the cache needs the block.
Everything here runs on the event-loop thread.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# The fields of the engine identity that name the KV a block holds (docs/reuse.md). Each one is hashed into the root.
# kernels: what the rounding of the process's kernels depends on besides torch's version (the CPU's ISA flags and
# torch's CPU capability, or the GPU and its CUDA), so a snapshot moved to a node of another ISA is foreign there.
# The fields in ENGINE_IDENTITY_FIELDS the engine names from what it computes with (engine.py): prefill_attention
# (cpu.c's row attention or None, the segmented flash calls), prefill_sparse (a block-sparse cell's settings) and
# decode_attention ("dispatch" where decoded K/V are a kernel's, within tolerance of a prefill's bits).
ENGINE_IDENTITY_FIELDS = ("prefill_attention", "prefill_sparse", "decode_attention")
IDENTITY_KEY_FIELDS = ("model_digest", "backend", "backend_version", "kernels", "weights_dtype", "weights_kernel",
                       "kv_dtype", "adapter", "tokenizer_hash", "template_hash", "manifest_hash",
                       *ENGINE_IDENTITY_FIELDS, "kv_layout", "block_size")


def root_hash(key: Mapping[str, object]) -> bytes:
    """The chain root for one identity: blake2b-128 of its canonical JSON (sorted keys)."""
    return hashlib.blake2b(json.dumps(dict(key), sort_keys=True, separators=(",", ":")).encode(),
                           digest_size=16, person=b"modeld-kv-root").digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash: blake2b-128(parent || u32 LE token ids)."""
    h = hashlib.blake2b(parent, digest_size=16, person=b"modeld-kv-blk")
    h.update(array("I", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class _Entry:
    hash: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_hash: dict[bytes, int] = {}
        self._entry: dict[int, _Entry] = {}
        self._children: dict[bytes, set[int]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()    # evictable (refcount 0) blocks, least recent first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block: int) -> bool:
        return block in self._entry

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def tokens(self, block: int) -> tuple[int, ...]:
        return self._entry[block].tokens

    def children(self, parent: bytes) -> list[int]:
        """Registered blocks that continue the prefix named by ``parent`` (candidates for a mid-block copy)."""
        return sorted(self._children.get(parent, ()))

    def register(self, block: int, h: bytes, parent: bytes, tokens: Sequence[int]) -> bool:
        """Name ``block`` by ``h``. False (nothing changed) when the hash already names a block (the same content
        computed twice: the first copy stays the shared one) or the block is already named."""
        if h in self._by_hash or block in self._entry:
            return False
        assert len(tokens) == self.block_size, f"only full blocks are indexed, got {len(tokens)} tokens"
        self._by_hash[h] = block
        self._entry[block] = _Entry(h, parent, tuple(tokens))
        self._children.setdefault(parent, set()).add(block)
        return True

    def unregister(self, block: int) -> None:
        e = self._entry.pop(block, None)
        if e is None:
            return
        del self._by_hash[e.hash]
        kids = self._children[e.parent]
        kids.discard(block)
        if not kids:
            del self._children[e.parent]
        self._lru.pop(block, None)

    # ---- LRU of unreferenced blocks (driven by the cache's refcounts)

    def park(self, block: int) -> None:
        """The block's refcount fell to 0: most recently used end of the LRU."""
        self._lru[block] = None
        self._lru.move_to_end(block)

    def unpark(self, block: int) -> None:
        self._lru.pop(block, None)

    def evict(self) -> int:
        """Drop the least recently used unreferenced block from the index and return its id (now free)."""
        block, _ = self._lru.popitem(last=False)
        self.unregister(block)
        self.evictions += 1
        return block

    def evict_where(self, pred: Callable[[int], bool]) -> int:
        """evict() of the least recently used unreferenced block for which pred(block) holds (KeyError: none)."""
        block = next((b for b in self._lru if pred(b)), None)
        if block is None:
            raise KeyError("no evictable block satisfies the predicate")
        self.unregister(block)
        self.evictions += 1
        return block

    def evictable_blocks(self) -> list[int]:
        """Least recent first (for tests and introspection)."""
        return list(self._lru)

    def clear_unreferenced(self) -> list[int]:
        """Drop every evictable block from the index; returns them (the cache frees them)."""
        out = list(self._lru)
        for b in out:
            self.unregister(b)
        return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share (where reuse would stop, or greedy outputs part)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
