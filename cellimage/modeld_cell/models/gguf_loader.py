"""Load a llama.cpp GGUF file: hyperparameters from its metadata, tensors dequantized to fp32, HF tensor names.

llama.cpp's converter permutes the rows of Q and K for llama / mistral so its RoPE can rotate adjacent pairs
(``convert_hf_to_gguf.LlamaModel.permute``):
    w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
We apply the inverse, exactly as transformers' GGUF loader does (``reverse_permute``), so the weights run with the
HF ``rotate_half`` RoPE in ``model.py``. Qwen2 GGUFs are not permuted (NEOX-style RoPE), so neither are they here.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from modeld_cell.model import ModelArgs
from modeld_cell.tokenizer import Tokenizer

from . import Checkpoint
from .gguf_file import GGUFFile

PERMUTED_ARCHS = ("llama", "mistral")   # architectures whose Q/K rows llama.cpp permutes
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF -> llama.cpp row order (what the converter does). w: [n_head * D, cols]."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reverse_permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp -> HF row order (inverse of ``permute_qk``). w: [n_head * D, cols] or a bias [n_head * D]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    v = reader.fields.get(key)
    return default if v is None else v


def read_hparams(reader: GGUFFile) -> ModelArgs:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHS})")

    def req(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF carries rope_freqs.weight (per-dimension RoPE factors); not supported yet")
    dim, n_heads = int(req("embedding_length")), int(req("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or _field(reader, f"{arch}.rope.dimension_count", 0)
                   or dim // n_heads)
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"])
    scaling = None
    stype = _field(reader, f"{arch}.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise ValueError(f"GGUF rope scaling {stype!r} not supported (linear only)")
        scaling = {"type": "linear", "factor": float(req("rope.scaling.factor"))}
    return ModelArgs(
        arch=arch, vocab_size=int(vocab), dim=dim, n_layers=int(req("block_count")), n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
        intermediate_size=int(req("feed_forward_length")),
        norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_seq_len=int(req("context_length")), tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        sliding_window=(int(_field(reader, f"{arch}.attention.sliding_window")) if
                        _field(reader, f"{arch}.attention.sliding_window") else None),
    )


def _hf_name(name: str) -> str | None:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return None


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    """Read hparams, tokenizer and all tensors (dequantized to fp32, HF names, Q/K un-permuted)."""
    with GGUFFile(path) as reader:
        args = read_hparams(reader)
        tensors: dict[str, torch.Tensor] = {}
        qtypes: dict[str, int] = {}
        stored: dict[str, str] = {}                                      # HF name -> the file's type (Q4_1, ...)
        for t in reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                raise ValueError(f"GGUF tensor {t.name!r} has no place in the {args.arch} model")
            w = torch.from_numpy(reader.dequantize(t))                  # fp32 [rows, cols], its own memory
            if args.arch in PERMUTED_ARCHS:
                if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
                    w = reverse_permute_qk(w, args.n_heads)
                elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
                    w = reverse_permute_qk(w, args.n_kv_heads)
            tensors[hf] = w
            qtypes[t.type_name] = qtypes.get(t.type_name, 0) + 1
            stored[hf] = t.type_name
        tok = Tokenizer.from_gguf_fields(reader.fields)
        name = _field(reader, "general.name") or os.path.basename(str(path))
        file_type = _field(reader, "general.file_type")
    return Checkpoint(args=args, tensors=tensors, tokenizer=tok, format="gguf", path=str(path),
                      info={"name": name, "architecture": args.arch, "tensor_types": qtypes, "stored_as": stored,
                            "file_type": file_type})
