"""GGUF loading on the real model: metadata, tokenizer, and quality (the Q/K un-permutation is proven on a small case
in tests/unit/test_gguf_permute.py)."""

from __future__ import annotations

import math

import pytest
import torch

from modeld_cell.model import ModelArgs

from .cellutil import full_logits

pytestmark = pytest.mark.cell


def test_hparams_match_named_config(engine):
    a = engine.model.args
    ref = ModelArgs.from_name("smollm2-135m")
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
              "rope_theta", "max_seq_len", "tie_embeddings", "qkv_bias"):
        assert getattr(a, f) == getattr(ref, f), f
    assert engine.model.output.weight is engine.model.tok_embeddings.weight   # tied


def test_tokenizer_round_trip_and_chat_template(engine):
    tok = engine.tokenizer
    for text in ["Hello, world!", "  leading spaces\tand tabs\n\nnew lines", "Numbers 12345 and 3.14159",
                 "Unicode: café, naïve, 日本語, emoji 🙂", "def f(x):\n    return x ** 2  # comment"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [tok.token_to_id(c) for c in "12345"]     # smollm: single digits
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    ids = tok.encode(chat)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2          # <|im_start|> / <|im_end|> are single ids
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1 and tok.vocab_size == 49152


def test_perplexity_on_ordinary_english(engine):
    text = ("The history of the city goes back more than two thousand years. It was founded as a small settlement "
            "on the banks of the river, where traders met to exchange goods. Over the centuries it grew into an "
            "important centre of commerce and culture. Today it is known for its museums, its old churches and "
            "its lively markets, which attract visitors from all over the world. The climate is mild, with warm "
            "summers and cool winters, and the surrounding countryside is famous for its vineyards.")
    ids = engine.tokenizer.encode(text)
    logits = full_logits(engine, ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    ppl = math.exp(float(nll))
    assert ppl < 20, f"perplexity {ppl:.1f}: wrong Q/K permutation or tokenizer gives hundreds"


def test_hf_loader_round_trip_gives_same_model(engine, tmp_path):
    """Write the loaded SmolLM2 as an HF directory (config.json, safetensors, tokenizer.json) and load it back
    through hf_loader: same hparams, same tokenizer ids, same logits (no permutation on the HF path)."""
    import json

    from safetensors.torch import save_file

    from modeld_cell.model import pack_linears
    from modeld_cell.models import build_model, load_checkpoint

    a, m = engine.model.args, engine.model
    own = m.state_dict()              # plain weights, also of layers held oneDNN-packed (model.RowLinear.pack)
    sd = {"model.embed_tokens.weight": own["tok_embeddings.weight"], "model.norm.weight": own["norm.weight"]}
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for i in range(a.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        wq, wk, wv = own[o + "attention.wqkv.weight"].split([q, kv, kv])
        gate, up = own[o + "feed_forward.w13.weight"].split(a.intermediate_size)
        sd.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                   p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": own[o + "attention.wo.weight"],
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": own[o + "feed_forward.w2.weight"],
                   p + "input_layernorm.weight": own[o + "attention_norm.weight"],
                   p + "post_attention_layernorm.weight": own[o + "ffn_norm.weight"]})
    save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": a.dim, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": True}))
    engine.tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": engine.tokenizer.chat_template}))
    ck = load_checkpoint(tmp_path)
    assert ck.format == "safetensors" and ck.args == a
    text = "The capital of France is Paris. 12345"
    assert ck.tokenizer.encode(text) == engine.tokenizer.encode(text)
    assert ck.tokenizer.eos_token_ids == engine.tokenizer.eos_token_ids
    model2, digest, _ = build_model(ck, torch.float32, use_digest_cache=False)
    assert digest == engine.identity["model_digest"]          # same weights actually loaded -> same digest
    if "oneDNN-packed" in engine.identity["weights_kernel"]:  # multiplied as the engine multiplies (packed fp32
        pack_linears(model2)                                  # rounds otherwise than plain: docs/reuse.md)
    ids = engine.tokenizer.encode(text)

    class _E:                                                 # full_logits needs .model and .kv
        model, kv = model2, engine.kv
    torch.testing.assert_close(full_logits(_E, ids), full_logits(engine, ids), atol=0, rtol=0)
