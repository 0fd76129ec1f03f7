"""Tokenizer (HF ``tokenizers``) and chat template (jinja2), built from a GGUF file or an HF tokenizer.json.

From GGUF: ``tokenizer.ggml.model == "gpt2"`` is byte-level BPE over ``tokenizer.ggml.tokens`` / ``.merges``; the
pre-tokenizer follows ``tokenizer.ggml.pre`` the way llama.cpp does (smollm / starcoder: single digits, then the
GPT-2 split). Control tokens (token_type 3) become special tokens, so "<|im_start|>" in a rendered chat template is
one id; user-defined tokens (type 4) are added tokens.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .prefix_index import common_prefix  # noqa: F401  (its home; imported from here by older callers)

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# token_type values in GGUF (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("gpt-2", "gpt2", "default", ""):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level])
    if pre in ("qwen2",):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (smollm, starcoder, gpt2, llama-bpe, qwen2)")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """encode(text) -> ids; decode(ids) -> text; apply_chat_template(messages) -> text.

    ``hash`` identifies vocabulary + merges + special ids (snapshots refuse a different one); ``template_hash`` the
    chat template source.
    """

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, identity: str, add_bos: bool = False) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.hash = "sha256:" + hashlib.sha256(identity.encode()).hexdigest()
        self.template_hash = "sha256:" + hashlib.sha256((chat_template or "").encode()).hexdigest()
        self._template = None
        if chat_template:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now)
            self._template = env.from_string(chat_template)

    # ---- construction

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """From a GGUF file's metadata (``models.gguf_file.GGUFFile.fields``)."""
        def get(key: str, default: Any = None) -> Any:
            v = fields.get(key)
            return default if v is None else v

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2 byte-level BPE only)")
        tokens: list[str] = get("tokenizer.ggml.tokens")
        merges: list[str] = get("tokenizer.ggml.merges") or []
        types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre", "default") or "default")
        tok.decoder = decoders.ByteLevel()
        specials = [AddedToken(tokens[i], special=True, normalized=False)
                    for i, t in enumerate(types) if int(t) == _CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if int(t) == _USER_DEFINED]
        tok.add_special_tokens(specials)
        if user:
            tok.add_tokens(user)
        bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        eot = get("tokenizer.ggml.eot_token_id")
        eos_ids = [int(x) for x in (eos, eot) if x is not None]
        ident = json.dumps({"tokens": tokens, "merges": merges, "types": [int(t) for t in types],
                            "pre": get("tokenizer.ggml.pre"), "bos": bos, "eos": eos_ids}, ensure_ascii=False)
        return cls(tok, bos_token_id=None if bos is None else int(bos), eos_token_ids=sorted(set(eos_ids)),
                   chat_template=get("tokenizer.chat_template"), identity=ident,
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str | Path, generation_eos: list[int] | None = None) -> Tokenizer:
        p = Path(path)
        tok = HFTokenizer.from_file(str(p / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (p / "tokenizer_config.json").exists():
            cfg = json.loads((p / "tokenizer_config.json").read_text())

        def tid(key: str) -> int | None:
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return tok.token_to_id(v) if isinstance(v, str) else None

        template = cfg.get("chat_template")
        if template is None and (p / "chat_template.jinja").exists():
            template = (p / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        eos = sorted({x for x in ([tid("eos_token")] + list(generation_eos or [])) if x is not None})
        ident = (p / "tokenizer.json").read_text()
        return cls(tok, bos_token_id=tid("bos_token"), eos_token_ids=eos, chat_template=template,
                   identity=ident, add_bos=bool(cfg.get("add_bos_token", False)))

    # ---- use

    def encode(self, text: str) -> list[int]:
        """Text -> ids. Special-token strings in ``text`` (e.g. "<|im_start|>") map to their single ids."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("this checkpoint carries no chat template")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos, **kwargs)
