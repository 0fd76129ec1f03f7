"""Weight-only quantized serving on the CPU: a quantizer that swaps a model's Linears (and its embedding table) for
modules whose forward is one packed matmul from torch's CPU kernels (gpt-fast ``quantize.py``'s shape).

Formats (``profile.weights``):
  int8   per output channel, symmetric: w = q * s, q in [-127, 127]; ``aten._weight_int8pack_mm``
  q4_1   llama.cpp's Q4_1 math, groups of 32 along the input: w = d * q + m, q in [0, 15];
         ``aten._weight_int4pack_mm_for_cpu``, whose groups dequantize as (q - 8) * scale + zero, so scale = d and
         zero = m + 8 d hold Q4_1's blocks exactly

The activations stay in the compute dtype (fp32 or bf16); nothing keeps a dequantized copy of a weight. Both kernels
give a row the same bits whatever the other rows of its call (the exactness probe, ``model.probe_chunking_invariance``,
measures this on the running CPU), so prefix reuse stays exact. The tied embedding table shares the head's quantized
rows: a lookup dequantizes only the rows of the tokens asked for.

The output head of a file that keeps it finer than the layers (a Q4_1 GGUF keeps its embedding table in Q8_0) is
served by the int8 kernel, per output row, unless told dense (``head_kernel``): a decode step reads the whole head,
and at bf16 it was the largest read of a q4_1 step (8.2 of 37 ms on an AMX Xeon, docs/cell-benchmarks.md). Per-row
scales are coarser than Q8_0's 32-value blocks, so the head's values move a little: the q4_1 quality smoke measures
the model as served, head included, and a smoke that fails it is answered by the same kernel with the head dense
(loader.load_engine).

The quantizer starts from the weights as loaded (fp32): a Q4_1 GGUF's tensors re-quantize to their own blocks (each
block's minimum and maximum are codes 0 and 15, so the recovered d and m are the file's up to fp32 rounding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# the formats this module serves, as profile.weights names them
FORMATS = ("int8", "q4_1")
# Bump when what a format's modules compute changes (packing, scales, which modules stay dense): it is part of
# ``model.weights_layout``, which the cache identity and the quality smoke's measurement key carry.
QUANTIZE_VERSION = 2                     # 2: a head the file keeps in Q8_0 is served int8 (head_kernel)
Q4_GROUP = 32


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [N, K] float -> (q [N, K] int8, s [N] fp32), symmetric per output row (an all-zero row gets s = 1)."""
    wf = w.float()
    s = wf.abs().amax(1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(wf / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def quantize_q4_1(w: Tensor, group: int = Q4_GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """w: [N, K] float, K % group == 0 -> (q [N, K] uint8 in [0, 15], d [N, K/group] fp32, m [N, K/group] fp32):
    Q4_1's asymmetric min/max blocks, w ~= d * q + m."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"q4_1: input size {k} is not a multiple of the group size {group}")
    wg = w.float().view(n, k // group, group)
    m = wg.amin(-1)
    d = (wg.amax(-1) - m) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((wg - m[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8).view(n, k)
    return q, d, m


def dequantize_q4_1(q: Tensor, d: Tensor, m: Tensor, group: int = Q4_GROUP) -> Tensor:
    """The reference: q [N, K] uint8, d, m [N, K/group] -> w [N, K] fp32."""
    n, k = q.shape
    return (q.view(n, k // group, group).float() * d[..., None] + m[..., None]).view(n, k)


def q4_1_blocks(w: Tensor, group: int = Q4_GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """The Q4_1 blocks the CPU layer step reads (kernels/paged_decode/cpu.c, ``gemv_q4``): w [N, K] float ->
    (qs [N, K/2] uint8, a group's 16 bytes holding weight j in the low nibble of byte j and weight j + 16 in its
    high nibble, as a GGUF Q4_1 block stores them; d, m [N, K/group] fp32). Of a layer the file stores in Q4_1 (its
    weights as loaded, fp32), these are the file's own blocks up to fp32 rounding of d and m (see the module
    docstring)."""
    q, d, m = quantize_q4_1(w, group)
    n, k = q.shape
    qg = q.view(n, k // group, group)
    half = group // 2
    qs = (qg[..., :half] | (qg[..., half:] << 4)).reshape(n, k // 2).contiguous()
    return qs, d.contiguous(), m.contiguous()


def q8_0_blocks(w: Tensor, group: int = Q4_GROUP) -> tuple[Tensor, Tensor]:
    """A head's Q8_0 blocks for the CPU layer step (cpu.c ``gemv_q8``): w [N, K] float, K % group == 0 -> (qs [N, K]
    int8, d [N, K/group] fp32), w ~= d * q, symmetric per group: d = max |w| / 127, q = round(w / d). Of a head the
    file stores in Q8_0 (dequantized to fp32 as loaded) these are the file's blocks: ggml's Q8_0 puts the group's
    largest magnitude at code 127, so max |w| / 127 is the file's fp16 d, exactly, and w / d its codes."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"q8_0: input size {k} is not a multiple of the group size {group}")
    wg = w.float().view(n, k // group, group)
    d = wg.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(wg * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(n, k)
    return q.contiguous(), d.contiguous()


def int8_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """Int8WeightOnlyLinear's multiply (TorchScript-compilable): x [N, K] @ (qweight * scales)^T (+ bias)."""
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight, scales)
    return y if bias is None else y + bias


def int4_linear(x: Tensor, packed: Tensor, group: int, scales_zeros: Tensor, bias: Tensor | None) -> Tensor:
    """Int4WeightOnlyLinear's multiply (TorchScript-compilable), through torch's packed int4 CPU kernel."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group, scales_zeros)
    return y if bias is None else y + bias


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (q * s)^T (+ bias): int8 weights, per-channel scales in the activations' dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, s = quantize_int8(weight)
        self.register_buffer("qweight", q)                      # [N, K] int8
        self.register_buffer("scales", s.to(dtype))             # [N]
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def rows(self, idx: Tensor, dtype: torch.dtype) -> Tensor:
        """The dequantized weight rows ``idx`` (an embedding lookup): [len(idx), K]."""
        return (self.qweight[idx].to(torch.float32) * self.scales[idx, None].float()).to(dtype)


class Int4WeightOnlyLinear(nn.Module):
    """y = x @ dequant_q4_1(w)^T (+ bias) through torch's packed int4 CPU kernel (groups of 32)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, keep_codes: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, d, m = quantize_q4_1(weight)
        self.group = Q4_GROUP
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        # [K/G, N, 2]: (scale, zero) with zero = m + 8 d, the kernel dequantizing (q - 8) * scale + zero
        self.register_buffer("scales_zeros", torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous().to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        # an embedding lookup needs rows back: the codes one per byte, and d / m (only for a tied embedding table)
        self.register_buffer("codes", q if keep_codes else None)
        self.register_buffer("d", d if keep_codes else None)
        self.register_buffer("m", m if keep_codes else None)

    def forward(self, x: Tensor) -> Tensor:
        return int4_linear(x, self.packed, self.group, self.scales_zeros, self.bias)

    def rows(self, idx: Tensor, dtype: torch.dtype) -> Tensor:
        if self.codes is None:
            raise RuntimeError("this int4 linear keeps no codes for row lookups")
        return dequantize_q4_1(self.codes[idx], self.d[idx], self.m[idx], self.group).to(dtype)


class QuantEmbedding(nn.Module):
    """An embedding table read from a quantized head (tied embeddings): dequantizes the looked-up rows only."""

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]                    # a plain list: the head's buffers belong to the model's output module
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head[0].rows(tokens, self.dtype)


def _linear_cls(fmt: str) -> Any:
    if fmt == "int8":
        return Int8WeightOnlyLinear
    if fmt == "q4_1":
        return Int4WeightOnlyLinear
    raise ValueError(f"weight format {fmt!r} is not quantized-served (served: {', '.join(FORMATS)})")


def quantized_linear(lin: nn.Linear, fmt: str, dtype: torch.dtype, keep_codes: bool = False) -> nn.Module:
    """The quantized module that replaces ``lin`` (its weight read once, in fp32)."""
    cls = _linear_cls(fmt)
    w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
    if cls is Int4WeightOnlyLinear:
        return cls(w, b, dtype, keep_codes=keep_codes)
    return cls(w, b, dtype)


# the model's Linears and the checkpoint (HF) tensors each is made of
SOURCES = {"attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.wo": ("self_attn.o_proj",), "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
           "feed_forward.w2": ("mlp.down_proj",)}
# the GGUF tensor type whose blocks a format's kernel multiplies as they are (int8 is a serving choice, no file type)
FILE_TYPE = {"q4_1": "Q4_1"}
# the file types of a head (or tied embedding table) the int8 kernel serves when a file format's layers are coarser
HEAD_INT8_FROM = ("Q8_0",)


def dense_modules(args: Any, fmt: str, stored_as: dict[str, str] | None) -> set[str]:
    """The modules ``quantize_model`` leaves dense for ``fmt``: with a file format (q4_1), those whose checkpoint
    tensors the file does not store in it (a Q4_1 GGUF keeps its embedding table / head in Q8_0: re-quantizing it
    to 4 bits would lose what the file kept). ``stored_as``: HF tensor name -> the file's type (a GGUF's)."""
    want = FILE_TYPE.get(fmt)
    if want is None or stored_as is None:
        return set()
    out = set()
    for i in range(args.n_layers):
        for mod, parts in SOURCES.items():
            if any(stored_as.get(f"model.layers.{i}.{p}.weight") != want for p in parts):
                out.add(f"layers.{i}.{mod}")
    head = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
    if stored_as.get(head) != want:
        out.add("output")
    return out


def head_kernel(args: Any, fmt: str, stored_as: dict[str, str] | None, int8_head: bool = True) -> str:
    """How ``quantize_model`` serves the output head for ``fmt``: ``fmt`` when the file stores the head as the
    layers (or names no types: a safetensors checkpoint, or int8, which is no file type); ``int8`` when the file keeps
    it in an 8-bit block format (HEAD_INT8_FROM) and ``int8_head``; else ``dense``."""
    want = FILE_TYPE.get(fmt)
    if want is None or stored_as is None:
        return fmt
    have = stored_as.get("model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight")
    if have == want:
        return fmt
    return "int8" if int8_head and have in HEAD_INT8_FROM else "dense"


@torch.no_grad()
def quantize_model(model: nn.Module, fmt: str, dtype: torch.dtype, dense: set[str] | None = None,
                   head: str | None = None) -> nn.Module:
    """Swap every transformer Linear and the output head of a loaded ``Transformer`` (weights in fp32) for ``fmt``'s
    weight-only modules computing in ``dtype``, but those named in ``dense`` (dense_modules), which move to ``dtype``
    as they are; norms move to ``dtype``, RoPE tables stay fp32. ``head`` (head_kernel: ``fmt``, ``int8`` or
    ``dense``; None: ``dense`` when ``dense`` names "output", else ``fmt``) is the head's kernel. A tied embedding
    table becomes a lookup into a quantized head. In place; returns the model."""
    _linear_cls(fmt)
    dense = set(dense or ())
    if head is None:
        head = "dense" if "output" in dense else fmt
    if head == "dense":
        dense.add("output")
    else:
        _linear_cls(head)
        dense.discard("output")

    def swap(name: str, lin: nn.Module, keep_codes: bool = False) -> nn.Module:
        if name in dense:
            return lin.to(dtype)
        return quantized_linear(lin, fmt, dtype, keep_codes=keep_codes)

    for i, layer in enumerate(model.layers):
        att, ff = layer.attention, layer.feed_forward
        att.wqkv = swap(f"layers.{i}.attention.wqkv", att.wqkv)
        att.wo = swap(f"layers.{i}.attention.wo", att.wo)
        ff.w13 = swap(f"layers.{i}.feed_forward.w13", ff.w13)
        ff.w2 = swap(f"layers.{i}.feed_forward.w2", ff.w2)
        for norm in (layer.attention_norm, layer.ffn_norm):
            norm.weight.data = norm.weight.data.to(dtype)
    model.norm.weight.data = model.norm.weight.data.to(dtype)
    tied = model.args.tie_embeddings
    if "output" in dense:
        model.tok_embeddings.weight.data = model.tok_embeddings.weight.data.to(dtype)
        if tied:
            model.output.weight = model.tok_embeddings.weight
        else:
            model.output.weight.data = model.output.weight.data.to(dtype)
    else:
        out = quantized_linear(model.output, head, dtype, keep_codes=tied)
        model.output = out
        if tied:
            model.tok_embeddings = QuantEmbedding(out, dtype)
        else:
            model.tok_embeddings.weight.data = model.tok_embeddings.weight.data.to(dtype)
    model.weights_layout = (f"{fmt} v{QUANTIZE_VERSION}" + (f"; head {head}" if head not in (fmt, "dense") else "")
                            + (f"; dense: {', '.join(sorted(dense))}" if dense else ""))
    return model


def weights_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take as served: parameters plus the quantized modules' buffers (not RoPE tables),
    plus the file's blocks a CPU decode step reads beside them (``decode_blocks``, ``decode_head_blocks``: the
    loader's, kept where that step serves)."""
    seen: set[int] = set()
    total = 0
    blocks = getattr(model, "decode_blocks", None) or []
    extra = [t for layer in blocks for lin in layer for t in lin] + list(getattr(model, "decode_head_blocks", None)
                                                                         or ())
    for name, t in [*model.named_parameters(), *model.named_buffers(), *(("decode_blocks", t) for t in extra)]:
        if name.startswith("rope_") or t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
