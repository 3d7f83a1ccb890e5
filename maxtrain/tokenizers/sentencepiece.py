"""A sentencepiece model (`.model` file): the default tokenizer and
tools/train_tokenizer.py's."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from maxtrain.tokenizers.base import TokenizerError


@dataclass(frozen=True)
class SentencePieceTokenizer:
    path: str
    sha256: str
    processor: spm.SentencePieceProcessor

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size()

    @property
    def bos_id(self) -> int:
        return self.processor.bos_id()

    @property
    def eos_id(self) -> int:
        return self.processor.eos_id()

    @property
    def pad_id(self) -> int:
        return self.processor.pad_id()

    def encode(self, texts: Sequence[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        # A batch call: sentencepiece tokenizes it on all cores.
        return self.processor.encode(list(texts), out_type=int, add_bos=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


def load_sentencepiece(path: str | Path) -> SentencePieceTokenizer:
    file = Path(path)
    data = file.read_bytes()
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"tokenizer {path} is not a valid sentencepiece model") from e
    return SentencePieceTokenizer(str(path), hashlib.sha256(data).hexdigest(), processor)
