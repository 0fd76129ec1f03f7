"""LoRA adapters in the PEFT format, merged into the model's weights at load.

An adapter is a local directory holding ``adapter_config.json`` + ``adapter_model.safetensors``, or the path of the
.safetensors file with the config beside it. Nothing here downloads. Every targeted linear layer becomes

    W' = W + scale * (B @ A)     A: [r, in], B: [out, r]; scale = alpha / r, or alpha / sqrt(r) with use_rslora

computed in fp32 and cast to the model's dtype. q/k/v land in their row ranges of the fused ``attention.wqkv``,
gate/up in ``feed_forward.w13`` (model.py). The merged model costs nothing extra per token; one cell serves one
adapter. Both sides use the HF weight layout (the GGUF loader undoes llama.cpp's Q/K permutation), so an adapter
trained with PEFT on the HF model applies unchanged.

Served: LoRA on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj of any layers, one rank for all.
Refused, with an error that names the problem (``field="model.adapter"``): missing paths or files, adapters that do
not fit the model (layer out of range, shape or rank mismatch, an A without its B), and PEFT features not
implemented here: embed_tokens / lm_head targets, modules_to_save, DoRA, fan_in_fan_out, biases, per-module ranks.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from modeld_cell import errors

if TYPE_CHECKING:
    from modeld_cell.model import ModelArgs, Transformer

FIELD = "model.adapter"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# target module -> (its parent in the HF model, the model.py weight it merges into)
TARGETS = {
    "q_proj": ("self_attn", "attention.wqkv"), "k_proj": ("self_attn", "attention.wqkv"),
    "v_proj": ("self_attn", "attention.wqkv"), "o_proj": ("self_attn", "attention.wo"),
    "gate_proj": ("mlp", "feed_forward.w13"), "up_proj": ("mlp", "feed_forward.w13"),
    "down_proj": ("mlp", "feed_forward.w2"),
}
# PEFT's saved names (the adapter name is stripped on save; some tools keep ".default")
_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")


def _bad(msg: str, **details: Any) -> errors.BadRequest:
    return errors.BadRequest(f"model.adapter: {msg}", field=FIELD, **details)


def _unsupported(msg: str, **details: Any) -> errors.Unsupported:
    return errors.Unsupported(f"model.adapter: {msg}", field=FIELD, **details)


def fused_rows(args: ModelArgs, module: str) -> tuple[int, int, int]:
    """(in_features, out_features, first row in the model.py weight) of a target module."""
    q, kv, inter = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.intermediate_size
    return {"q_proj": (args.dim, q, 0), "k_proj": (args.dim, kv, q), "v_proj": (args.dim, kv, q + kv),
            "o_proj": (q, args.dim, 0), "gate_proj": (args.dim, inter, 0), "up_proj": (args.dim, inter, inter),
            "down_proj": (inter, args.dim, 0)}[module]


@dataclass
class LoraAdapter:
    ref: str                      # as the cell names it
    path: str                     # the .safetensors file read
    sha256: str                   # of that file (hex)
    rank: int
    alpha: float
    use_rslora: bool
    # (layer, module) -> (A [r, in], B [out, r]), fp32 on the CPU
    pairs: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict)
    base_model: str | None = None  # adapter_config.json's base_model_name_or_path (informative only)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def describe(self) -> dict[str, Any]:
        """What the engine identity and the capability report carry: the file's content names the adapter."""
        return {"ref": self.ref, "sha256": self.sha256, "rank": self.rank, "alpha": self.alpha, "scale": self.scale,
                "use_rslora": self.use_rslora, "targets": sorted({m for _, m in self.pairs}),
                "layers": sorted({i for i, _ in self.pairs})}


def resolve(ref: str) -> tuple[Path, Path]:
    """(weights file, config file) of an adapter reference: a local directory or .safetensors file."""
    p = Path(ref).expanduser()
    if not p.exists():
        raise _bad(f"{ref!r} does not exist (an adapter is a local directory with {CONFIG_FILE} + {WEIGHTS_FILE}, "
                   "or that .safetensors file; nothing is downloaded)", path=str(p.absolute()))
    if p.is_dir():
        weights = p / WEIGHTS_FILE
        if not weights.exists():
            if (p / "adapter_model.bin").exists():
                raise _unsupported(f"{p} holds adapter_model.bin (a pickle); convert it to {WEIGHTS_FILE}")
            raise _bad(f"{p} has no {WEIGHTS_FILE}")
    elif p.suffix == ".safetensors":
        weights = p
    else:
        raise _bad(f"{p} is neither a directory nor a .safetensors file")
    config = weights.parent / CONFIG_FILE
    if not config.exists():
        raise _bad(f"{config} not found (it gives r, lora_alpha and target_modules)")
    return weights, config


def _read_config(path: Path) -> tuple[int, float, bool, str | None]:
    """Validate adapter_config.json; returns (r, lora_alpha, use_rslora, base_model_name_or_path)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _bad(f"{path} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _bad(f"{path} is not a JSON object")
    peft_type = str(cfg.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise _unsupported(f"peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise _unsupported("use_dora: DoRA adapters are not supported (only plain LoRA)")
    if cfg.get("fan_in_fan_out"):
        raise _unsupported("fan_in_fan_out=true (GPT-2 Conv1D layout) is not supported; Llama-family linear "
                           "weights are [out, in]")
    if (cfg.get("bias") or "none") != "none" or cfg.get("lora_bias"):
        raise _unsupported(f"bias {cfg.get('bias')!r}: trained biases are not supported (only bias 'none')")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication", "target_parameters"):
        if cfg.get(key):
            raise _unsupported(f"{key} {cfg[key]!r} is not supported (plain LoRA on {', '.join(TARGETS)} only)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):   # a str is a regex (or "all-linear"): the tensors present are checked instead
        other = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
        if other:
            raise _unsupported(f"target_modules {other} not supported (supported: {', '.join(TARGETS)})")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _bad(f"{path}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _bad(f"{path}: lora_alpha must be a number, got {alpha!r}")
    return r, float(alpha), bool(cfg.get("use_rslora")), cfg.get("base_model_name_or_path")


def _unsupported_tensor(name: str) -> errors.ContractError:
    for word, what in (("embed_tokens", "LoRA on embed_tokens"), ("lm_head", "LoRA on lm_head"),
                       ("modules_to_save", "modules_to_save (fully trained copies of modules)"),
                       ("lora_magnitude_vector", "DoRA (lora_magnitude_vector)"), ("bias", "trained biases")):
        if word in name:
            return _unsupported(f"tensor {name}: {what} is not supported", tensor=name)
    m = re.search(r"\.(\w+)\.lora_[AB]\b", name)
    if m and m[1] not in TARGETS:
        return _unsupported(f"tensor {name}: target {m[1]!r} not supported (supported: {', '.join(TARGETS)})",
                            tensor=name)
    return _bad(f"tensor {name} is not a LoRA weight this worker knows (expected names like "
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)", tensor=name)


def load_adapter(ref: str, args: ModelArgs) -> LoraAdapter:
    """Read and validate an adapter against the model's shapes. Touches no model; raises before anything merges."""
    from safetensors.torch import load_file

    from .fetch import file_sha256

    weights, config = resolve(ref)
    r, alpha, rslora, base = _read_config(config)
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error type for a corrupt header
        raise _bad(f"{weights} is not a readable safetensors file ({e})") from None
    if not tensors:
        raise _bad(f"{weights} holds no tensors")
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.fullmatch(name)
        if m is None or m[3] not in TARGETS or TARGETS[m[3]][0] != m[2]:
            raise _unsupported_tensor(name)
        layer = int(m[1])
        if layer >= args.n_layers:
            raise _bad(f"tensor {name}: layer {layer} out of range (the model has {args.n_layers} layers)",
                       tensor=name)
        if not t.is_floating_point() or t.dim() != 2:
            raise _bad(f"tensor {name}: expected a 2-d float matrix, got {t.dtype} {list(t.shape)}", tensor=name)
        parts.setdefault((layer, m[3]), {})[m[4]] = t
    pairs: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"layer {layer} {module}"
        if len(ab) != 2:
            lacking = "lora_B" if "A" in ab else "lora_A"
            raise _bad(f"{where}: {lacking} is missing (every target needs both A and B)")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise _bad(f"{where}: rank mismatch: lora_A {list(a.shape)}, lora_B {list(b.shape)}, but r={r} in "
                       f"{CONFIG_FILE}")
        fin, fout, _ = fused_rows(args, module)
        if a.shape[1] != fin or b.shape[0] != fout:
            raise _bad(f"{where}: shape mismatch: lora_A {list(a.shape)}, lora_B {list(b.shape)}; this model needs "
                       f"[{r}, {fin}] and [{fout}, {r}] (an adapter for another model?)")
        pairs[(layer, module)] = (a.float(), b.float())
    return LoraAdapter(ref=ref, path=str(weights), sha256=file_sha256(weights), rank=r, alpha=alpha,
                       use_rslora=rslora, pairs=pairs, base_model=base)


@torch.no_grad()
def merge(model: Transformer, adapter: LoraAdapter) -> None:
    """W' = W + scale * (B @ A) in fp32, cast to the weight's dtype. Replaces the touched weights with new tensors
    (the old ones may share storage with the checkpoint's)."""
    own = dict(model.named_parameters())
    for (layer, module), (a, b) in sorted(adapter.pairs.items()):
        w = own[f"layers.{layer}.{TARGETS[module][1]}.weight"]     # w: [out_total, in]
        _, fout, row = fused_rows(model.args, module)
        merged = w.detach().to(torch.float32, copy=True)
        delta = b.to(w.device) @ a.to(w.device)                     # [out, in] fp32
        merged[row : row + fout].add_(delta, alpha=adapter.scale)
        w.data = merged.to(w.dtype)

