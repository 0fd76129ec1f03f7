"""Paged KV cache: fixed-size blocks, a free list, per-session block tables, an explicit byte budget.

Layout (vLLM "NHD", what ``kernels/paged_decode`` reads):
    k[layer]: [num_blocks, BLOCK_SIZE, Hkv, D]      v[layer]: the same
The whole pool is allocated once, at the budget; sessions own lists of block ids (their block tables). Allocation
checks the free list first and raises ``errors.Overflow`` before touching any state, so a refused request leaves
every session as it was.

Quantized formats (``kernels/quant_kv/reference.py`` owns the layouts) store K/V at low precision plus fp16 scales:
    int8, fp8 e4m3  k[layer]: [num_blocks, BS, Hkv, D] 1-byte values,  k_scale[layer]: [num_blocks, BS, Hkv]
    int4            k[layer]: [num_blocks, BS, Hkv, D // 2] uint8, two values per byte,
                    k_scale[layer]: [num_blocks, BS, Hkv, D // 32] (one scale per 32-value group),
                    values rotated before quantizing: quantize(k @ R), R the format's fixed Hadamard rotation
likewise ``v`` / ``v_scale``. Writes quantize (``quant_kv.reference.quantize``); readers dequantize only the blocks
they read (``quant_kv.reference.dequantize``). No full-precision copy of the cache exists.

Blocks are refcounted: a full block can be shared by several sessions (prefix reuse, ``prefix_index.PrefixIndex``).
A block whose count drops to 0 goes back to the free list, or, when the index names it, stays cached and evictable
(LRU); allocation takes free blocks first and evicts cached ones only when the free list is empty. A block some
session references is never evicted, so Overflow means the *live* blocks exhaust the budget.
"""

from __future__ import annotations

import heapq
import math
import mmap
from dataclasses import dataclass

import torch
from torch import Tensor

from . import errors
from .kernels.quant_kv import reference as quant_ref
from .prefix_index import PrefixIndex

DEFAULT_BLOCK_SIZE = 16            # tokens per block
DEFAULT_KV_MEMORY_MIB = 1024       # budget when the spec gives no kvMemoryMiB


@dataclass(frozen=True)
class KVFormat:
    """How K/V are stored. ``storage`` is the pool's element dtype; ``quant`` names the ``kernels/quant_kv`` format
    ("int8" | "fp8" | "int4") when values are quantized with fp16 scales, else None."""

    name: str
    storage: torch.dtype
    quant: str | None = None

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()

    def value_dim(self, head_dim: int) -> int:
        """Last dim of the stored K/V: head_dim, or head_dim // 2 bytes for packed int4."""
        return quant_ref.value_dim(self.quant, head_dim) if self.quant else head_dim

    def scale_tail(self, head_dim: int) -> tuple[int, ...]:
        """Scale shape per token per kv head: () for int8 / fp8, (head_dim // 32,) for int4."""
        return quant_ref.scale_shape(self.quant, head_dim) if self.quant else ()

    @property
    def scales(self) -> str | None:
        """The scale layout in words (capability report), None when unquantized."""
        if self.quant is None:
            return None
        group = f", one per {quant_ref.INT4_GROUP} values" if self.quant == "int4" else ""
        rotated = "; values Hadamard-rotated (x @ R)" if quant_ref.is_rotated(self.quant) else ""
        return f"{str(quant_ref.SCALE_DTYPE).removeprefix('torch.')} per token per kv head{group}{rotated}"


KV_FORMATS = {
    "fp32": KVFormat("fp32", torch.float32),
    "bf16": KVFormat("bf16", torch.bfloat16),
    "fp16": KVFormat("fp16", torch.float16),
    "int8": KVFormat("int8", torch.int8, quant="int8"),
    "fp8-e4m3": KVFormat("fp8-e4m3", torch.float8_e4m3fn, quant="fp8"),
    "int4": KVFormat("int4", torch.uint8, quant="int4"),
}
# Every stored format is a KV precision a cell may ask for. Whether a lossy one (int8, fp8-e4m3, int4) is served is
# decided when the cell starts, by its quality smoke measured on that machine (profile_gate.py), not here.
KV_FORMAT_NAMES = sorted(KV_FORMATS)


def kv_format(name: str) -> KVFormat:
    """The format a spec names (the CRD's profile.kv values); BadRequest if unknown."""
    if name in KV_FORMATS:
        return KV_FORMATS[name]
    raise errors.BadRequest(f"unknown KV precision {name!r}; expected one of {KV_FORMAT_NAMES}", kv=name)


def _raw(t: Tensor) -> Tensor:
    """An fp8 tensor as uint8 (same bytes): CPU index_copy_/index_select have no Float8 kernels."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> Tensor:
    """A zero tensor. On the CPU it is backed by an anonymous mmap: the kernel hands out zero pages as they are first
    written, so a KV pool costs resident memory only for the blocks sessions have filled (torch.zeros writes every
    byte at start, making the whole budget resident before the first request)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n)                          # the tensor holds the mapping alive (torch.frombuffer keeps it)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    t._modeld_pages = buf                           # type: ignore[attr-defined]  # release_pages' handle
    return t


def release_pages(t: Tensor) -> int:
    """Give a ``zeroed`` CPU tensor's pages back to the system: it reads as zeros again and costs no resident memory
    until written (the mapping is shared anonymous memory, so MADV_REMOVE, not MADV_DONTNEED, frees it). Returns
    the bytes released; 0 for any other tensor, or where this platform has no MADV_REMOVE."""
    buf = getattr(t, "_modeld_pages", None)
    if buf is None or not hasattr(mmap, "MADV_REMOVE"):
        return 0
    buf.madvise(mmap.MADV_REMOVE)
    return len(buf)


class PagedKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, fmt: KVFormat, budget_bytes: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, device: str | torch.device = "cpu") -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.fmt = fmt
        self.block_size = block_size
        self.budget_bytes = int(budget_bytes)
        self.num_blocks = self.budget_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise errors.BadRequest(f"KV budget {budget_bytes} bytes holds no block of {self.block_bytes} bytes",
                                    budget_bytes=budget_bytes, block_bytes=self.block_bytes)
        self.value_dim = fmt.value_dim(head_dim)                       # D, or D // 2 (int4 packed)
        self.scale_tail = fmt.scale_tail(head_dim)                     # (), or (D // 32,) (int4 groups)
        shape = (n_layers, self.num_blocks, block_size, n_kv_heads, self.value_dim)
        # zeros, not empty: a kernel that reads a partly filled block must never see NaN garbage (0 * NaN = NaN)
        self.k = zeroed(shape, fmt.storage, device)                    # k: [L, num_blocks, BS, Hkv, D or D // 2]
        self.v = zeroed(shape, fmt.storage, device)
        # quantized formats: fp16 scales per token per kv head (per group for int4); None otherwise
        self.k_scale: Tensor | None = None                  # k_scale: [L, num_blocks, BS, Hkv] (+ [D // 32] int4)
        self.v_scale: Tensor | None = None
        if fmt.quantized:
            sshape = (*shape[:-1], *self.scale_tail)
            self.k_scale = zeroed(sshape, quant_ref.SCALE_DTYPE, device)
            self.v_scale = zeroed(sshape, quant_ref.SCALE_DTYPE, device)
        self._free: list[int] = list(range(self.num_blocks))           # min-heap: low ids first keeps runs contiguous
        heapq.heapify(self._free)
        self.ref: list[int] = [0] * self.num_blocks                     # sessions (and copies in flight) per block
        self.index = PrefixIndex(block_size)

    # ---- sizes (bytes)

    @property
    def bytes_per_token(self) -> int:
        """K and V, all layers, scales included (``quant_kv.reference.bytes_per_token``): 2 * L * Hkv * (bytes of D
        values + 2 bytes per fp16 scale); SmolLM2: bf16 23,040, int8 / fp8 11,880, int4 6,480."""
        return quant_ref.bytes_per_token(self.fmt.quant or self.fmt.name, self.n_layers, self.n_kv_heads,
                                         self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def max_tokens(self) -> int:
        """Tokens that fit in the whole budget (all sessions together)."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or cached but unreferenced (evicted on demand)."""
        return len(self._free) + self.index.evictable

    @property
    def used_blocks(self) -> int:
        """Blocks some session references (vLLM's usage: cached unreferenced blocks count as free)."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks the prefix index names (referenced or not)."""
        return len(self.index)

    @property
    def usage_ratio(self) -> float:
        return self.used_blocks / self.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def device(self) -> torch.device:
        """Where the pool's tensors live (for a rank's bookkeeping pool: that rank's own blocks)."""
        return self.k.device

    def release_pages(self) -> int:
        """While no block holds K/V anyone can read (none allocated, none cached), give the pool's pages back to the
        system: the start-up measurements (runner.choose_*) prefill and decode into scratch blocks, up to 8k tokens'
        worth, and free them, which left up to 180 MiB of a CPU pool resident after load. The pool then reads as
        zeros, as a fresh one does. Returns the bytes released (0 while blocks are in use, or on a device)."""
        if len(self._free) != self.num_blocks or len(self.index) > 0:
            return 0
        return sum(release_pages(t) for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    # ---- allocation (host side, event-loop thread only)

    def allocate(self, n_blocks: int, after: int | None = None, first: int = 0) -> list[int]:
        """Take n_blocks from the free list; Overflow (nothing taken) when fewer are free.

        ``after``: the caller's last block; when after+1, after+2, ... are free they are taken first, so a growing
        session stays one contiguous run (attention then reads a zero-copy view instead of gathering blocks).
        ``first``: the session's index of the first block taken (a pool whose blocks live on several ranks,
        parallel/sharded_kv.ShardedPool, places blocks by it; here every block is alike).
        """
        if n_blocks < 0:
            raise ValueError(f"n_blocks {n_blocks} < 0")
        if n_blocks > self.free_blocks:
            raise errors.Overflow(
                f"KV memory exhausted: need {n_blocks} blocks ({n_blocks * self.block_size} tokens), "
                f"{self.free_blocks} free of {self.num_blocks}",
                needed_blocks=n_blocks, free_blocks=self.free_blocks, block_size=self.block_size,
                budget_bytes=self.budget_bytes)
        out: list[int] = []
        if after is not None and n_blocks:
            free = set(self._free)
            nxt = after + 1
            while len(out) < n_blocks and nxt in free:
                out.append(nxt)
                nxt += 1
            if out:
                taken = set(out)
                self._free = [b for b in self._free if b not in taken]
                heapq.heapify(self._free)
        while len(out) < n_blocks and self._free:
            out.append(heapq.heappop(self._free))
        while len(out) < n_blocks:
            out.append(self.index.evict())                          # least recently used unreferenced block
        for b in out:
            self.ref[b] = 1
        return out

    def acquire(self, blocks: list[int]) -> None:
        """One more reference to each (cached or live) block; a cached unreferenced one leaves the LRU."""
        for b in blocks:
            if self.ref[b] == 0:
                if b not in self.index:
                    raise ValueError(f"block {b} is free; only live or cached blocks can be shared")
                self.index.unpark(b)
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block, in order. At 0 a cached block joins the LRU's recent end (so release a
        chain tail first: its tail is then evicted first), any other block the free list."""
        for b in blocks:
            if self.ref[b] <= 0:
                raise ValueError(f"block {b} released more often than referenced")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.index:
                    self.index.park(b)
                else:
                    self._push_free(b)

    def _push_free(self, block: int) -> None:
        """A block no one references and the index does not name goes back to the free list."""
        heapq.heappush(self._free, block)

    def forget(self, block: int) -> None:
        """Un-name a block (it is about to be overwritten by its only holder)."""
        self.index.unregister(block)

    def clear_cache(self) -> int:
        """Free every cached unreferenced block (a cold start for benchmarks); returns how many."""
        out = self.index.clear_unreferenced()
        for b in out:
            self._push_free(b)
        return len(out)

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """K/V of the first n slots of block src into block dst, all layers (copy-on-write; torch thread)."""
        self.k[:, dst, :n].copy_(self.k[:, src, :n])
        self.v[:, dst, :n].copy_(self.v[:, src, :n])
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale[:, dst, :n].copy_(self.k_scale[:, src, :n])
            self.v_scale[:, dst, :n].copy_(self.v_scale[:, src, :n])

    # ---- data (torch thread)

    def k_layer(self, layer: int) -> Tensor:
        return self.k[layer]  # [num_blocks, BS, Hkv, D]

    def v_layer(self, layer: int) -> Tensor:
        return self.v[layer]

    def scales_layer(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """(k_scale, v_scale) of a layer, each [num_blocks, BS, Hkv] (+ [D // 32] for int4) fp16; None for an
        unquantized format."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale[layer], self.v_scale[layer]

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """k, v: [N, Hkv, D] float; slots: [N] int64 flat slot ids (block * BS + offset). Quantizes on write."""
        flat = (-1, self.n_kv_heads, self.value_dim)
        if self.k_scale is None or self.v_scale is None:
            self.k[layer].view(flat).index_copy_(0, slots, k.to(self.fmt.storage))
            self.v[layer].view(flat).index_copy_(0, slots, v.to(self.fmt.storage))
            return
        for x, cache, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            if quant_ref.is_rotated(self.fmt.quant):       # int4 stores x @ R (quant_kv.reference: rotation)
                x = quant_ref.rotate(x)
            q, s = quant_ref.quantize(x, self.fmt.quant)   # q: [N, Hkv, D or D // 2], s: [N, Hkv (, D // 32)] fp16
            _raw(cache[layer].view(flat)).index_copy_(0, slots, _raw(q))
            scale[layer].view(-1, self.n_kv_heads, *self.scale_tail).index_copy_(0, slots, s)

    def slots(self, blocks: list[int], start: int, end: int) -> Tensor:
        """Flat slot ids of token positions [start, end) of a session with block table ``blocks``: [end-start]."""
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def read_tokens(self, blocks: list[int], n: int) -> tuple[Tensor, Tensor]:
        """A copy of the first n tokens' K and V as stored: each [L, n, Hkv, D or D // 2] (for snapshots)."""
        idx = self.slots(blocks, 0, n).to(self.k.device)
        shape = (self.n_layers, -1, self.n_kv_heads, self.value_dim)
        k = _raw(self.k.view(shape)).index_select(1, idx).view(self.fmt.storage)
        v = _raw(self.v.view(shape)).index_select(1, idx).view(self.fmt.storage)
        return k, v

    def read_scales(self, blocks: list[int], n: int) -> tuple[Tensor, Tensor] | None:
        """A copy of the first n tokens' K and V scales, each [L, n, Hkv (, D // 32)] fp16; None if unquantized."""
        if self.k_scale is None or self.v_scale is None:
            return None
        idx = self.slots(blocks, 0, n).to(self.k.device)
        shape = (self.n_layers, -1, self.n_kv_heads, *self.scale_tail)
        return self.k_scale.view(shape).index_select(1, idx), self.v_scale.view(shape).index_select(1, idx)

    def read_payload(self, blocks: list[int], n: int) -> list[tuple[str, Tensor]]:
        """The first n tokens' K/V (and scales when quantized) as stored, named as payload_spec names them."""
        k, v = self.read_tokens(blocks, n)
        out = [("k", k), ("v", v)]
        if (sc := self.read_scales(blocks, n)) is not None:
            out += [("k_scale", sc[0]), ("v_scale", sc[1])]
        return out

    def write_payload(self, blocks: list[int], payload: dict[str, Tensor]) -> None:
        """Inverse of read_payload: a payload by those names (any device) into positions [0, n) of ``blocks``."""
        dev = self.device
        scales = (payload["k_scale"].to(dev), payload["v_scale"].to(dev)) if "k_scale" in payload else None
        self.write_tokens(blocks, payload["k"].to(dev), payload["v"].to(dev), scales)

    def payload_spec(self, n: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """What read_tokens + read_scales return for n tokens, by snapshot tensor name: {name: (dtype, shape)}."""
        vals = (self.n_layers, n, self.n_kv_heads, self.value_dim)
        out = {"k": (self.fmt.storage, vals), "v": (self.fmt.storage, vals)}
        if self.fmt.quantized:
            sc = (self.n_layers, n, self.n_kv_heads, *self.scale_tail)
            out.update({"k_scale": (quant_ref.SCALE_DTYPE, sc), "v_scale": (quant_ref.SCALE_DTYPE, sc)})
        return out

    def write_tokens(self, blocks: list[int], k: Tensor, v: Tensor,
                     scales: tuple[Tensor, Tensor] | None = None) -> None:
        """Inverse of read_tokens (+ read_scales): k, v [L, n, Hkv, D or D // 2] as stored into positions [0, n) of
        ``blocks``; scales (k_scale, v_scale) [L, n, Hkv (, D // 32)] are required exactly when the format is
        quantized."""
        if (scales is None) != (self.k_scale is None):
            raise ValueError(f"KV format {self.fmt.name}: scales must be given exactly for quantized formats")
        idx = self.slots(blocks, 0, k.shape[1]).to(self.k.device)
        shape = (self.n_layers, -1, self.n_kv_heads, self.value_dim)
        _raw(self.k.view(shape)).index_copy_(1, idx, _raw(k.to(self.fmt.storage)))
        _raw(self.v.view(shape)).index_copy_(1, idx, _raw(v.to(self.fmt.storage)))
        if scales is not None and self.k_scale is not None and self.v_scale is not None:
            sshape = (self.n_layers, -1, self.n_kv_heads, *self.scale_tail)
            self.k_scale.view(sshape).index_copy_(1, idx, scales[0].to(self.k_scale.dtype))
            self.v_scale.view(sshape).index_copy_(1, idx, scales[1].to(self.v_scale.dtype))

    def stats(self) -> dict:
        return {"dtype": self.fmt.name, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "free_blocks": self.free_blocks, "cached_blocks": self.cached_blocks,
                "evictable_blocks": self.index.evictable, "evictions": self.index.evictions, "bytes_per_token": self.bytes_per_token,
                "budget_bytes": self.budget_bytes, "max_tokens": self.max_tokens,
                "usage_ratio": self.usage_ratio}
