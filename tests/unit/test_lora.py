"""LoRA adapter files (spec.model.adapter) without the model: models/lora.py reads PEFT-format files written here
for SmolLM2's shapes (dim 576, 9 q heads, 3 kv heads, head dim 64, intermediate 1536, 30 layers; ModelArgs only),
merges into a tiny random Transformer, and refuses every unsupported or broken adapter naming model.adapter.

The writer helpers (ROWS, LAYOUT, random_pairs, write_adapter) are shared with tests/cell/test_adapter.py, which
merges the same files into the real SmolLM2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modeld_cell import errors
from modeld_cell.model import ModelArgs, Transformer
from modeld_cell.models import lora
from modeld_cell.models.fetch import file_sha256

pytestmark = pytest.mark.unit

ARGS = ModelArgs.from_name("smollm2-135m")
R, ALPHA = 4, 8.0
Q, KV, INTER = 9 * 64, 3 * 64, 1536
# module -> (model.py weight, its rows, in_features): the fused layouts written out independently of lora.py
ROWS = {"q_proj": ("attention.wqkv", slice(0, Q), 576), "k_proj": ("attention.wqkv", slice(Q, Q + KV), 576),
        "v_proj": ("attention.wqkv", slice(Q + KV, Q + 2 * KV), 576), "o_proj": ("attention.wo", slice(None), Q),
        "gate_proj": ("feed_forward.w13", slice(0, INTER), 576),
        "up_proj": ("feed_forward.w13", slice(INTER, 2 * INTER), 576),
        "down_proj": ("feed_forward.w2", slice(None), INTER)}
OUT = {"q_proj": Q, "k_proj": KV, "v_proj": KV, "o_proj": 576, "gate_proj": INTER, "up_proj": INTER,
       "down_proj": 576}
# layer 0 leaves wqkv's k rows alone, layer 29 its q and v rows: untouched rows inside a fused weight are checked too
LAYOUT = {0: ("q_proj", "v_proj", "down_proj"), 13: tuple(ROWS), 29: ("k_proj", "up_proj")}


def tensor_name(layer: int, module: str, ab: str) -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{ab}.weight"


def random_pairs(seed: int = 0, rank: int = R, zero_b: bool = False) -> dict[tuple[int, str], tuple]:
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for layer, modules in LAYOUT.items():
        for m in modules:
            a = torch.randn(rank, ROWS[m][2], generator=g) * 0.05                       # A: [r, in]
            b = torch.zeros(OUT[m], rank) if zero_b else torch.randn(OUT[m], rank, generator=g) * 0.05  # [out, r]
            pairs[(layer, m)] = (a, b)
    return pairs


def write_adapter(d: Path, pairs: dict, rank: int = R, tensors: dict | None = None, **config) -> Path:
    """A PEFT adapter directory: adapter_config.json + adapter_model.safetensors."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
           "target_modules": sorted({m for _, m in pairs}) or ["q_proj"], "task_type": "CAUSAL_LM",
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", **config}
    (d / lora.CONFIG_FILE).write_text(json.dumps(cfg))
    flat = {tensor_name(i, m, ab): t.contiguous() for (i, m), (a, b) in pairs.items() for ab, t in (("A", a), ("B", b))}
    save_file({**flat, **(tensors or {})}, str(d / lora.WEIGHTS_FILE))
    return d


def test_rslora_changes_the_scale(tmp_path):
    pairs = random_pairs(seed=1)
    plain = lora.load_adapter(str(write_adapter(tmp_path / "plain", pairs)), ARGS)
    rs = lora.load_adapter(str(write_adapter(tmp_path / "rs", pairs, use_rslora=True)), ARGS)
    assert plain.scale == ALPHA / R == 2.0 and rs.scale == ALPHA / R**0.5 == 4.0
    assert plain.sha256 == rs.sha256 and plain.describe() != rs.describe()     # the config is part of the identity


def test_merge_computes_in_fp32_and_keeps_the_dtype(tmp_path):
    """A tiny bf16 model: the merge casts once from fp32, leaves the dtype and the tied embedding alone."""
    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48,
                     max_seq_len=32, tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(args).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    pairs = {(1, "k_proj"): (torch.randn(2, 32, generator=g), torch.randn(16, 2, generator=g)),
             (1, "up_proj"): (torch.randn(2, 32, generator=g), torch.randn(48, 2, generator=g))}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = lora.load_adapter(str(write_adapter(tmp_path / "tiny", pairs, rank=2, use_rslora=True)), model.args)
    lora.merge(model, adapter)
    desc = adapter.describe()
    scale = ALPHA / 2**0.5
    assert desc["scale"] == scale and desc["targets"] == ["k_proj", "up_proj"] and desc["layers"] == [1]
    after = model.state_dict()
    for (layer, m), (a, b), rows in (((1, "k_proj"), pairs[(1, "k_proj")], slice(32, 48)),
                                     ((1, "up_proj"), pairs[(1, "up_proj")], slice(48, 96))):
        key = f"layers.{layer}.{ROWS[m][0]}.weight"
        assert after[key].dtype == torch.bfloat16
        want = (before[key][rows].float() + scale * (b @ a)).to(torch.bfloat16)
        torch.testing.assert_close(after[key][rows], want, atol=0, rtol=2**-7)   # one bf16 ulp
    assert torch.equal(after["layers.1.attention.wqkv.weight"][:32], before["layers.1.attention.wqkv.weight"][:32])
    assert torch.equal(after["tok_embeddings.weight"], before["tok_embeddings.weight"])
    assert model.output.weight is model.tok_embeddings.weight


def test_relative_path_and_safetensors_file_refs(tmp_path, monkeypatch):
    d = write_adapter(tmp_path / "rel", random_pairs(seed=3))
    monkeypatch.chdir(tmp_path)
    by_dir = lora.load_adapter("rel", ARGS)
    by_file = lora.load_adapter(os.path.join("rel", lora.WEIGHTS_FILE), ARGS)
    assert by_dir.sha256 == by_file.sha256 == file_sha256(d / lora.WEIGHTS_FILE)
    assert by_dir.rank == R and len(by_dir.pairs) == sum(len(v) for v in LAYOUT.values())


def _a(m: str = "q_proj", rank: int = R) -> torch.Tensor:
    return torch.zeros(rank, ROWS[m][2])


def _b(m: str = "q_proj", rank: int = R) -> torch.Tensor:
    return torch.zeros(OUT[m], rank)


ONE = {(0, "q_proj"): (_a(), _b())}
# name -> (pairs, extra tensors, config overrides, error type, message pattern)
BAD = {
    "embed_tokens": (ONE, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(R, 49152)}, {},
                     errors.Unsupported, "embed_tokens"),
    "lm_head": (ONE, {"base_model.model.lm_head.lora_A.weight": torch.zeros(R, 576)}, {},
                errors.Unsupported, "lm_head"),
    "lm_head-target": (ONE, {}, {"target_modules": ["q_proj", "lm_head"]}, errors.Unsupported, "lm_head"),
    "modules_to_save": (ONE, {}, {"modules_to_save": ["lm_head"]}, errors.Unsupported, "modules_to_save"),
    "modules_to_save-tensor": (ONE, {"base_model.model.score.modules_to_save.weight": torch.zeros(2, 576)}, {},
                               errors.Unsupported, "modules_to_save"),
    "dora": (ONE, {}, {"use_dora": True}, errors.Unsupported, "DoRA"),
    "dora-tensor": (ONE, {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(Q)},
                    {}, errors.Unsupported, "DoRA"),
    "fan_in_fan_out": (ONE, {}, {"fan_in_fan_out": True}, errors.Unsupported, "fan_in_fan_out"),
    "bias": (ONE, {}, {"bias": "lora_only"}, errors.Unsupported, "bias"),
    "rank_pattern": (ONE, {}, {"rank_pattern": {"q_proj": 8}}, errors.Unsupported, "rank_pattern"),
    "peft_type": (ONE, {}, {"peft_type": "IA3"}, errors.Unsupported, "peft_type 'IA3'"),
    "other-target": (ONE, {"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": torch.zeros(R, 576)},
                     {}, errors.Unsupported, "target 'qkv_proj' not supported"),
    "unknown-tensor": (ONE, {"something.else.weight": torch.zeros(2, 2)}, {}, errors.BadRequest,
                       "something.else.weight is not a LoRA weight"),
    "layer-out-of-range": ({(30, "q_proj"): (_a(), _b())}, {}, {}, errors.BadRequest, "layer 30 out of range"),
    "shape-mismatch": ({(0, "q_proj"): (torch.zeros(R, 960), _b())}, {}, {}, errors.BadRequest,
                       r"layer 0 q_proj: shape mismatch"),
    "missing-B": ({}, {tensor_name(0, "q_proj", "A"): _a()}, {}, errors.BadRequest, "lora_B is missing"),
    "missing-A": ({}, {tensor_name(0, "v_proj", "B"): _b("v_proj")}, {}, errors.BadRequest, "lora_A is missing"),
    "rank-vs-config": (ONE, {}, {"r": 8}, errors.BadRequest, "rank mismatch.*r=8"),
    "rank-A-vs-B": ({(0, "q_proj"): (_a(), _b(rank=2))}, {}, {}, errors.BadRequest, "rank mismatch"),
    "r-not-positive": (ONE, {}, {"r": 0}, errors.BadRequest, "r must be a positive integer"),
    "no-tensors": ({}, {}, {}, errors.BadRequest, "holds no tensors"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused(tmp_path, case):
    pairs, tensors, config, kind, pattern = BAD[case]
    d = write_adapter(tmp_path / case, pairs, tensors=tensors, **config)
    with pytest.raises(kind, match=pattern) as ei:
        lora.load_adapter(str(d), ARGS)
    assert type(ei.value) is kind and ei.value.details["field"] == "model.adapter"
    assert ei.value.message.startswith("model.adapter: ")


def _bad_files(tmp_path: Path) -> dict[str, tuple[str, type, str]]:
    ok = write_adapter(tmp_path / "ok", ONE)
    (tmp_path / "no-config").mkdir()
    (ok / lora.WEIGHTS_FILE).replace(tmp_path / "no-config" / lora.WEIGHTS_FILE)   # ok/ keeps only its config
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"\x80\x04")
    (tmp_path / "bin" / lora.CONFIG_FILE).write_text("{}")
    corrupt = write_adapter(tmp_path / "corrupt", ONE)
    (corrupt / lora.WEIGHTS_FILE).write_bytes(b"not a safetensors file at all")
    badjson = write_adapter(tmp_path / "badjson", ONE)
    (badjson / lora.CONFIG_FILE).write_text("{r: 4")
    (tmp_path / "notes.txt").write_text("hi")
    return {
        "missing-path": (str(tmp_path / "nope"), errors.BadRequest, "does not exist"),
        "hub-name": ("someone/some-lora", errors.BadRequest, "'someone/some-lora' does not exist.*nothing is downl"),
        "no-weights": (str(ok), errors.BadRequest, "has no adapter_model.safetensors"),
        "no-config": (str(tmp_path / "no-config"), errors.BadRequest, "adapter_config.json not found"),
        "bin-only": (str(tmp_path / "bin"), errors.Unsupported, "adapter_model.bin"),
        "corrupt": (str(corrupt), errors.BadRequest, "not a readable safetensors file"),
        "bad-json": (str(badjson), errors.BadRequest, "not readable JSON"),
        "other-file": (str(tmp_path / "notes.txt"), errors.BadRequest, "neither a directory nor a .safetensors"),
    }


def test_bad_adapter_files_are_refused(tmp_path):
    for case, (ref, kind, pattern) in _bad_files(tmp_path).items():
        with pytest.raises(kind, match=pattern) as ei:
            lora.load_adapter(ref, ARGS)
        assert type(ei.value) is kind and ei.value.details["field"] == "model.adapter", case
