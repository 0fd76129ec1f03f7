"""Load an HF checkpoint directory: config.json + *.safetensors + tokenizer.json (+ tokenizer_config.json).

Only local files; nothing here downloads. Weights keep their HF names (``model.layers.{i}.self_attn.q_proj.weight``),
already in the ``rotate_half`` layout ``model.py`` uses, so no permutation is applied.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from modeld_cell.model import ModelArgs
from modeld_cell.tokenizer import Tokenizer

from . import Checkpoint

_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def args_from_config(cfg: dict) -> ModelArgs:
    arch = next((_ARCHS[a] for a in cfg.get("architectures", []) if a in _ARCHS), None)
    if arch is None:
        raise ValueError(f"architectures {cfg.get('architectures')} not supported (supported: {sorted(_ARCHS)})")
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    return ModelArgs(
        arch=arch, vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or dim // n_heads), intermediate_size=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"), max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None),
    )


def load_hf(path: str | Path) -> Checkpoint:
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p}: no config.json")
    cfg = json.loads((p / "config.json").read_text())
    args = args_from_config(cfg)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{p}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            tensors[name] = t.float()
    gen_eos: list[int] = []
    if (p / "generation_config.json").exists():
        e = json.loads((p / "generation_config.json").read_text()).get("eos_token_id")
        gen_eos = e if isinstance(e, list) else ([e] if e is not None else [])
    tok = Tokenizer.from_hf_dir(p, generation_eos=gen_eos)
    return Checkpoint(args=args, tensors=tensors, tokenizer=tok, format="safetensors", path=str(p),
                      info={"name": cfg.get("_name_or_path") or p.name, "architecture": args.arch})
