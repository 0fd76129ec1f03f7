"""A one-session CPU decode step compiled as one TorchScript graph: the same aten calls as the eager step, without
Python between them.

A decode step of SmolLM2-135M is some 3,000 op calls from Python (30 layers of RMSNorm, the row-duplicated
linears, RoPE, the K/V write, ``model.segmented_row``'s two flash calls and merge, SwiGLU). Each call pays the
interpreter and the argument parsing before the dispatcher; on a 2-core VM that was a quarter of a step. Here the
layer loop is ``torch.jit.script`` of the SAME Python functions the eager path calls (``model.rms_norm``,
``model.row_linear``, ``model.rope_rotate``, ``model.segmented_row``, ``quantize.int8_linear`` /
``int4_linear``), so both run the same aten ops on the same inputs in the same order: same bits, which exact prefix
reuse needs (a decoded token's K/V are what a later prefill of it computes; docs/reuse.md). Graph optimisation is
off for the call (``torch.jit.optimized_execution(False)``): no fuser may regroup the arithmetic.

Nothing is taken on trust: ``TorchRunner.choose_decode_step`` compares the scripted step's logits and the K/V it
writes with the eager step's, bit for bit, on the loaded model at start, and times both; a step that differs is never
served. What it covers: the torch runner on the CPU (chunking-invariant path), one session, an unquantized KV cache,
a model whose layers are this package's Transformer blocks with RowLinear (plain or oneDNN-packed) or the int8 /
int4 weight-only linears. Anything else decodes eagerly, and ``eligible`` says why.

``torch.jit.script`` is deprecated in favour of torch.compile / torch.export (torch 2.x warns); neither of those keeps
the eager bits on the CPU without a C++ compiler at start, and where scripting fails the eager step serves, with
the reason in the capability report.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import model as M
from . import quantize as Q
from .kernels.paged_decode import cpu as cpu_attention  # registers torch.ops.modeld.paged_decode_cpu
from .runner import contig_start

PLAIN, PACKED, INT8, INT4 = 0, 1, 2, 3          # how a linear multiplies (``_linear``'s kind)


def _linear(x: Tensor, kind: int, w: Tensor, aux: Tensor | None, bias: Tensor | None, group: int,
            exact: bool) -> Tensor:
    """A layer linear as the eager module multiplies it. kind: PLAIN 0, PACKED 1, INT8 2, INT4 3 (literals:
    TorchScript reads no module globals); aux: int8 scales or int4 scales_zeros; group: int4's group, or a
    RowLinear's row tile. ``exact`` False: a dense row is multiplied alone, untiled (the recomputing step)."""
    if kind == 2:
        assert aux is not None
        return Q.int8_linear(x, w, aux, bias)
    if kind == 3:
        assert aux is not None
        return Q.int4_linear(x, w, group, aux, bias)
    if not exact:
        return M._mm(x, w, bias, kind == 1)
    return M.row_linear(x, w, bias, kind == 1, group)


def one_call_row(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """A decode row's attention as one flash call over all its keys (the recomputing step): q [1, Hq, D], k, v
    [n, Hkv, D] (the row's own key last). A query head's group of Hq / Hkv rows attends to its KV head as one flash
    head; no mask: a decode row sees every cached key. Not the bits of a prefill of the row
    (``model.segmented_row`` is: 512-key segments and an LSE merge), which is why the tokens it decodes are
    computed again by the next prefill."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.view(1, hkv, hq // hkv, d), k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0), scale=scale)
    return r[0].reshape(1, hq, d)


def _past(cache: Tensor, table: Tensor, start: int, n: int, bs: int, dtype: torch.dtype) -> Tensor:
    """The session's first n cached tokens [n, Hkv, D] in ``dtype`` (model._past_float of an unquantized cache):
    a view of the block run from block ``start`` when the blocks are consecutive (start >= 0), else gathered."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    if start >= 0:
        return flat[start * bs : start * bs + n].to(dtype)
    nblk = (n + bs - 1) // bs
    return cache.index_select(0, table[:nblk].long()).view(-1, cache.shape[2], cache.shape[3])[:n].to(dtype)


def decode_layers(x: Tensor, cos: Tensor, ssin: Tensor, norms: list[Tensor], kinds: list[int], ws: list[Tensor],
                  auxs: list[Tensor | None], biases: list[Tensor | None], groups: list[int], kc: list[Tensor],
                  vc: list[Tensor], slot: Tensor, table: Tensor, start: int, n: int, bs: int, eps: float, hq: int,
                  hkv: int, d: int, inter: int, seg: int, causal: Tensor, zeros: Tensor, scale: float,
                  exact: bool = True, kernel: bool = False) -> Tensor:
    """Every transformer layer of one session's decode step (model.TransformerBlock.forward with a decode
    AttnMetadata of one session). x: [1, dim] embedded token; cos, ssin: model.rope_rows of its position;
    norms: 2 per layer (attention, ffn); kinds/ws/auxs/biases/groups: 4 linears per layer (wqkv, wo, w13, w2);
    kc, vc: each layer's cache [num_blocks, BS, Hkv, D]; slot: [1] the token's flat slot; table: [nblk] int32 block table;
    start: first block when consecutive else -1; n: tokens in the cache after this step; exact: the eager step's
    ops (the bits a prefill of the token computes), else the recomputing step's (``one_call_row``, a dense row
    multiplied alone); kernel: the row's attention by the CPU kernels (kernels/paged_decode/cpu.c) reading the cache
    in place through ``table``: the exact step's by the row attention (where a prefill attends through it), the
    recomputing step's by the paged-decode kernel. Returns x [1, dim]."""
    for i in range(len(kc)):
        j = 4 * i
        qkv = _linear(M.rms_norm(x, norms[2 * i], eps), kinds[j], ws[j], auxs[j], biases[j], groups[j], exact)
        qk = M.rope_rotate(qkv[:, : (hq + hkv) * d].view(1, hq + hkv, d), cos, ssin)
        q, k = qk[:, :hq], qk[:, hq:]
        v = qkv[:, (hq + hkv) * d :].view(1, hkv, d)
        kc[i].view(-1, hkv, d).index_copy_(0, slot, k.to(kc[i].dtype))      # PagedKVCache.write
        vc[i].view(-1, hkv, d).index_copy_(0, slot, v.to(vc[i].dtype))
        if kernel and exact:      # the row attention a prefill of the token runs (cpu.c's, in place)
            o = torch.ops.modeld.rows_attention_cpu(q[0:1], kc[i], vc[i], table, n - 1, scale)
        elif kernel:
            o = torch.ops.modeld.paged_decode_cpu(q[0:1], kc[i], vc[i], table, n, scale)
        else:
            kp = _past(kc[i], table, start, n, bs, q.dtype)
            vp = _past(vc[i], table, start, n, bs, q.dtype)
            if exact:
                o = M.segmented_row(q[0:1], kp, vp, n - 1, scale, seg, causal, zeros)
            else:
                o = one_call_row(q[0:1], kp, vp, scale)
        h = x + _linear(o.reshape(1, hq * d), kinds[j + 1], ws[j + 1], auxs[j + 1], biases[j + 1], groups[j + 1],
                        exact)
        gu = _linear(M.rms_norm(h, norms[2 * i + 1], eps), kinds[j + 2], ws[j + 2], auxs[j + 2], biases[j + 2],
                     groups[j + 2], exact).split(inter, -1)
        x = h + _linear(F.silu(gu[0]) * gu[1], kinds[j + 3], ws[j + 3], auxs[j + 3], biases[j + 3], groups[j + 3],
                        exact)
    return x


def _linear_args(mod: torch.nn.Module) -> tuple[int, Tensor, Tensor | None, Tensor | None, int] | None:
    """(kind, weight, aux, bias, group or row tile) of a layer linear, or None when the scripted step cannot
    multiply it."""
    if type(mod) is M.RowLinear:
        if mod.packed is not None:
            return PACKED, mod.packed, None, mod.bias, mod.tile
        return PLAIN, mod.weight, None, mod.bias, mod.tile
    if type(mod) is Q.Int8WeightOnlyLinear:
        return INT8, mod.qweight, mod.scales, mod.bias, 0
    if type(mod) is Q.Int4WeightOnlyLinear:
        return INT4, mod.packed, mod.scales_zeros, mod.bias, mod.group
    return None


def eligible(model: Any, kv: Any) -> str | None:
    """None when the scripted step can serve this model and cache, else why not (in words)."""
    if not isinstance(model, M.Transformer):
        return f"the model is a {type(model).__name__}, not model.Transformer"
    if not M.chunking_invariant(kv.k.device):
        return f"{kv.k.device.type}: not the CPU chunking-invariant path"
    if kv.fmt.quantized:
        return f"the KV cache is quantized ({kv.fmt.quant}): its decode dequantizes eagerly"
    for i, layer in enumerate(model.layers):
        if type(layer) is not M.TransformerBlock or type(layer.attention) is not M.Attention \
                or type(layer.feed_forward) is not M.FeedForward \
                or type(layer.attention_norm) is not M.RMSNorm or type(layer.ffn_norm) is not M.RMSNorm:
            return f"layer {i} is not a plain TransformerBlock"
        for name, mod in (("wqkv", layer.attention.wqkv), ("wo", layer.attention.wo), ("w13", layer.feed_forward.w13),
                          ("w2", layer.feed_forward.w2)):
            if _linear_args(mod) is None:
                return f"layer {i} {name} is a {type(mod).__name__}"
            if mod._forward_hooks or mod._forward_pre_hooks:
                return f"layer {i} {name} has forward hooks"
    return None


def kernel_eligible(model: Any, kv: Any) -> str | None:
    """None when the recomputing step can take its attention from the CPU paged-decode kernel (loaded, and this
    cache's and model's dtypes are ones it reads), else why not."""
    if not cpu_attention.loaded():
        return "the CPU paged-decode kernel is not loaded"
    ok = (torch.float32, torch.bfloat16)
    if kv.k.dtype not in ok or model.compute_dtype not in ok:
        return f"the kernel reads fp32/bf16; this cache is {kv.k.dtype}, the compute dtype {model.compute_dtype}"
    if not (kv.k.is_contiguous() and kv.v.is_contiguous()):
        return "the KV pool is not contiguous"
    return None


class ScriptedDecode:
    """The compiled step over a model and its KV cache. Call with one token, its position and the session's block
    table; returns fp32 logits [1, V] (what ``model(...)`` returns for a one-session decode forward). The weights are
    read off the modules at every call, so packing or unpacking them later is followed. ``exact`` False: the
    recomputing step (``decode_layers``' exact=False; its tokens' K/V are computed again by the next prefill);
    ``kernel`` True: its attention by the CPU kernels (``kernel_eligible``): the exact step's by the row attention
    (only where the runner's prefills attend through it), the recomputing step's by the paged-decode kernel."""

    def __init__(self, model: Any, kv: Any, exact: bool = True, kernel: bool = False) -> None:
        why = eligible(model, kv)
        if why is None and kernel:
            why = kernel_eligible(model, kv)
        if why is not None:
            raise ValueError(why)
        self.model, self.kv, self.exact, self.kernel = model, kv, exact, kernel
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)      # torch.jit.script's deprecation notice
            self.fn = torch.jit.script(decode_layers)
        a = model.args
        self._dims = (a.norm_eps, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size)

    @torch.inference_mode()
    def __call__(self, tok: int, pos: int, table: list[int]) -> Tensor:
        m, kv = self.model, self.kv
        dev = kv.k.device
        norms: list[Tensor] = []
        kinds: list[int] = []
        ws: list[Tensor] = []
        auxs: list[Tensor | None] = []
        biases: list[Tensor | None] = []
        groups: list[int] = []
        for layer in m.layers:
            norms += [layer.attention_norm.weight, layer.ffn_norm.weight]
            for mod in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
                args = _linear_args(mod)
                if args is None:
                    raise ValueError(f"{type(mod).__name__}: the scripted decode step cannot multiply it")
                kinds.append(args[0])
                ws.append(args[1])
                auxs.append(args[2])
                biases.append(args[3])
                groups.append(args[4])
        eps, hq, hkv, d, inter = self._dims
        bs = kv.block_size
        n = pos + 1
        nblk = kv.blocks_for(n)
        first = contig_start(table, nblk)
        start = -1 if first is None else first
        positions = torch.tensor([pos], dtype=torch.long, device=dev)
        x = m.tok_embeddings(torch.tensor([tok], dtype=torch.long, device=dev))
        cos, ssin = M.rope_rows(m.rope_cos[positions], m.rope_sin[positions])
        dtype = m.compute_dtype
        with torch.jit.optimized_execution(False):
            x = self.fn(x, cos, ssin, norms, kinds, ws, auxs, biases, groups,
                        [kv.k_layer(i) for i in range(len(m.layers))], [kv.v_layer(i) for i in range(len(m.layers))],
                        torch.tensor([table[pos // bs] * bs + pos % bs], dtype=torch.long, device=dev),
                        torch.tensor(table[:nblk], dtype=torch.int32, device=dev), start, n, bs, eps, hq, hkv, d,
                        inter, M.ATTN_SEGMENT, M._causal_rows(M.ATTN_SEGMENT, dtype, dev),
                        M._zeros(hkv, M.ATTN_SEGMENT, d, dtype, dev), 1.0 / math.sqrt(d), self.exact, self.kernel)
        return m.logits(x)


def layers_eligible_weights(model: Any, blocks: Any = None) -> str | None:
    """The weights half of ``layers_eligible``: None when every layer linear is a plain RowLinear (oneDNN-packed
    weights are opaque to C) in the compute dtype (fp32 or bf16) with no bias, or ``blocks`` gives each layer's
    linears as Q4_1 blocks (``q4_blocks``), and the RMSNorm weights are in the compute dtype; else why not."""
    dtype = getattr(model, "compute_dtype", None)
    if not isinstance(model, M.Transformer) or dtype not in (torch.float32, torch.bfloat16):
        return f"the layer step multiplies fp32/bf16 model.Transformer weights, not {type(model).__name__} in {dtype}"
    if blocks is not None and len(blocks) != len(model.layers):
        return f"{len(blocks)} layers of Q4_1 blocks for a model of {len(model.layers)}"
    for i, layer in enumerate(model.layers):
        if type(layer) is not M.TransformerBlock:
            return f"layer {i} is not a plain TransformerBlock"
        for j, (name, mod) in enumerate((("wqkv", layer.attention.wqkv), ("wo", layer.attention.wo),
                                         ("w13", layer.feed_forward.w13), ("w2", layer.feed_forward.w2))):
            if blocks is not None:
                qs, d, _ = blocks[i][j]
                if mod.bias is not None or (qs.shape[0], qs.shape[1] * 2) != (mod.out_features, mod.in_features):
                    return f"layer {i} {name}: a bias, or Q4_1 blocks of another shape than the linear"
                continue
            if type(mod) is not M.RowLinear or mod.packed is not None:
                what = "oneDNN-packed" if type(mod) is M.RowLinear else f"a {type(mod).__name__}"
                return f"layer {i} {name} is {what}: the layer step multiplies plain dense weights"
            if mod.bias is not None or mod.weight.dtype != dtype or not mod.weight.is_contiguous():
                return f"layer {i} {name} has a bias, another dtype than {dtype} or a strided weight"
        for norm in (layer.attention_norm, layer.ffn_norm):
            if norm.weight.dtype != dtype:
                return f"layer {i}: an RMSNorm weight in {norm.weight.dtype}, not {dtype}"
    return None


def layers_eligible(model: Any, kv: Any, blocks: Any = None) -> str | None:
    """None when ``KernelDecode`` (cpu.c's whole-layer step) can serve this model and cache, else why not: what the
    scripted step takes (``eligible``) with the attention kernel (``kernel_eligible``), and plain dense weights or
    Q4_1 blocks of them (``layers_eligible_weights``)."""
    return eligible(model, kv) or kernel_eligible(model, kv) or layers_eligible_weights(model, blocks)


def q4_blocks(model: Any) -> list[list[tuple[Tensor, Tensor, Tensor]]] | None:
    """Each layer's four linears (wqkv, wo, w13, w2) as the Q4_1 blocks ``KernelDecode`` reads (quantize.q4_1_blocks
    of the dense weights as loaded), or None where a linear is not a plain dense RowLinear whose input size is a
    multiple of 32. Only for a model whose file stores those layers in Q4_1 (the loader's call): of other weights
    the blocks would be another model."""
    out = []
    for layer in model.layers:
        mods = (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)
        if any(type(m) is not M.RowLinear or m.weight is None or m.in_features % Q.Q4_GROUP for m in mods):
            return None
        out.append([Q.q4_1_blocks(m.weight.detach().float()) for m in mods])
    return out


class KernelDecode:
    """The recomputing step as one C call for all layers (kernels/paged_decode/cpu.c ``modeld_decode_layers``), then
    the head in torch: what ``ScriptedDecode(exact=False, kernel=True)`` computes, with the activations rounded where
    that step rounds them, but fp32 sums in another order (the linears are not oneDNN's), so its bits are its own.
    Its tokens' K/V are computed again by the next prefill, as every recomputing step's are. The weight pointers are
    taken at construction and checked at every call against the modules' weights: a model re-packed or re-loaded
    since raises instead of reading freed memory.

    ``blocks`` (``q4_blocks``): the layers' linears read as Q4_1 blocks instead of the dense weights, a fifth of fp32's
    bytes and two fifths of bf16's, for a file that stores them so (the blocks are its own values, the dense weights
    their dequantized copy). The step holds the blocks; the dense weights may then be oneDNN-packed for prefill.
    ``head`` (quantize.q8_0_blocks of the head): the head read as the Q8_0 blocks a file keeps it in, likewise."""

    def __init__(self, model: Any, kv: Any, threads: int = 1, blocks: Any = None,
                 head: tuple[Tensor, Tensor] | None = None) -> None:
        why = layers_eligible(model, kv, blocks)
        if why is not None:
            raise ValueError(why)
        import ctypes

        self.model, self.kv = model, kv
        self.exact, self.kernel, self.threads = False, True, threads
        self.blocks = blocks
        out = model.output
        if head is not None and (head[0].shape != out.weight.shape if getattr(out, "weight", None) is not None
                                 else head[0].shape[0] != model.args.vocab_size):
            raise ValueError(f"Q8_0 head blocks of {tuple(head[0].shape)} for a head of {model.args.vocab_size} rows")
        self.head_blocks = head
        self._pool = (kv.k, kv.v)
        self._weights = self._weights_now()
        if blocks is None:                                                   # cpu.c's L_PTRS a layer, in its order
            self._held = [t for i, w in enumerate(self._weights) for t in (*w, kv.k_layer(i), kv.v_layer(i))]
        else:                                                                # cpu.c's Q_PTRS
            self._held = [t for i, w in enumerate(self._weights) for t in (
                *w, *(b for lin in blocks[i] for b in lin), kv.k_layer(i), kv.v_layer(i))]
        self._ptrs = (ctypes.c_void_p * len(self._held))(*[t.data_ptr() for t in self._held])
        a = model.args
        self._dims = (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size)
        out = model.output                  # the head by the kernel's row linear too, where it is a plain dense one
        self._head = (type(out) in (M.RowLinear, torch.nn.Linear) and getattr(out, "packed", None) is None
                      and out.bias is None and out.weight.dtype == model.compute_dtype and out.weight.is_contiguous())
        self._eps, self._scale = float(a.norm_eps), 1.0 / math.sqrt(a.head_dim)

    def _weights_now(self) -> list[tuple[Tensor, ...]]:
        """Each layer's norm and (dense step) linear weights as the modules hold them now."""
        return [(layer.attention_norm.weight, layer.ffn_norm.weight) + (() if self.blocks is not None else (
                 layer.attention.wqkv.weight, layer.attention.wo.weight, layer.feed_forward.w13.weight,
                 layer.feed_forward.w2.weight)) for layer in self.model.layers]

    def _current(self) -> bool:
        """The weights and the KV pool are the ones whose pointers were taken (the pool's tensors are whole: a
        layer's view of them is where it was)."""
        if self.kv.k is not self._pool[0] or self.kv.v is not self._pool[1]:
            return False
        return all(t is h or (t is not None and t.data_ptr() == h.data_ptr())
                   for now, held in zip(self._weights_now(), self._weights, strict=True)
                   for t, h in zip(now, held, strict=True))

    @torch.inference_mode()
    def __call__(self, tok: int, pos: int, table: list[int]) -> Tensor:
        if not self._current():
            raise RuntimeError("the model's weights or KV pool changed since the layer step was built")
        m, kv = self.model, self.kv
        bs = kv.block_size
        n = pos + 1
        tab = torch.tensor(table[: kv.blocks_for(n)], dtype=torch.int32)
        positions = torch.tensor([pos], dtype=torch.long)
        x = m.tok_embeddings(torch.tensor([tok], dtype=torch.long)).float().contiguous().view(-1)
        cos, ssin = (t.float().contiguous().view(-1) for t in M.rope_rows(m.rope_cos[positions],
                                                                            m.rope_sin[positions]))
        cpu_attention.decode_layers(x, self._ptrs, len(m.layers), cos, ssin, table[pos // bs] * bs
                                    + pos % bs, tab, n, bs, self._dims, self._eps, self._scale,
                                    m.compute_dtype == torch.bfloat16, kv.k.dtype == torch.bfloat16, self.threads,
                                    self.blocks is not None)
        h = x.to(m.compute_dtype).view(1, -1)
        if self.head_blocks is not None:
            y = cpu_attention.gemv_q8(*self.head_blocks, m.norm(h).float().view(-1), threads=self.threads)
            return y.to(m.compute_dtype).float().view(1, -1)
        if not self._head:
            return m.logits(h)
        y = cpu_attention.gemv(m.output.weight, m.norm(h).view(-1), threads=self.threads)
        return y.to(m.compute_dtype).float().view(1, -1)      # rounded as the torch head's output is, then fp32
