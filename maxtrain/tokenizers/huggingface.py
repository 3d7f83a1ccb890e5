"""A Hugging Face `tokenizer.json` (the `tokenizers` package), with its special tokens.

The tokenizer file itself does not say which token is BOS, EOS or padding; the model's other
files do. They are read in the order transformers gives them precedence for a tokenizer:
tokenizer_config.json, then special_tokens_map.json (token strings, or {"content": ...}), then
generation_config.json and config.json (token ids). An EOS given as a list (several stop ids)
contributes its first entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from maxtrain.common.errors import first_line
from maxtrain.tokenizers.base import TokenizerError

TOKENIZER_JSON = "tokenizer.json"
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # special tokens as strings
ID_FILES = ("generation_config.json", "config.json")  # special tokens as ids
SPECIALS = ("bos", "eos", "pad")


@dataclass(frozen=True)
class HuggingFaceTokenizer:
    path: str
    sha256: str
    backend: tokenizers.Tokenizer
    special_ids: dict[str, int]  # "bos", "eos", "pad" -> id, -1 when the model names none

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self.special_ids["bos"]

    @property
    def eos_id(self) -> int:
        return self.special_ids["eos"]

    @property
    def pad_id(self) -> int:
        return self.special_ids["pad"]

    def encode(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)


def load_huggingface(path: str | Path) -> HuggingFaceTokenizer:
    """`path` is a tokenizer.json; its special tokens come from the files beside it."""
    file = Path(path)
    data = file.read_bytes()
    try:
        backend = tokenizers.Tokenizer.from_str(data.decode())
    except Exception as e:  # the Rust side raises plain Exception; bad UTF-8 UnicodeDecodeError
        raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json: {first_line(e)}") from e
    special_ids = _special_ids(backend, file.parent)
    identity = data + json.dumps(special_ids, sort_keys=True).encode()
    return HuggingFaceTokenizer(
        str(path), hashlib.sha256(identity).hexdigest(), backend, special_ids
    )


def _special_ids(backend: tokenizers.Tokenizer, directory: Path) -> dict[str, int]:
    found: dict[str, int] = {}
    for name in TOKEN_FILES:
        settings = _read_json(directory / name)
        for special in SPECIALS:
            token = settings.get(f"{special}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if special not in found and isinstance(token, str):
                token_id = backend.token_to_id(token)
                if token_id is None:
                    raise TokenizerError(
                        f"{directory / name}: {special}_token {token!r} is not in "
                        f"{directory / TOKENIZER_JSON}'s vocabulary"
                    )
                found[special] = token_id
    for name in ID_FILES:
        settings = _read_json(directory / name)
        for special in SPECIALS:
            token_id = settings.get(f"{special}_token_id")
            if isinstance(token_id, list):
                token_id = token_id[0] if token_id else None
            if special not in found and isinstance(token_id, int):
                found[special] = token_id
    return {special: found.get(special, -1) for special in SPECIALS}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {first_line(e)}") from e
    if not isinstance(settings, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return settings
