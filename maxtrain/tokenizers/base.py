"""The interface every tokenizer implements, and its error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from maxtrain.data.errors import DataError


class TokenizerError(DataError):
    """A tokenizer file that is missing, unreadable, or lacks a token maxtrain needs."""


class Tokenizer(Protocol):
    """Text <-> token ids. Special ids are -1 where the tokenizer has none.

    `encode` adds no special tokens unless asked: pre-training data is documents delimited by
    EOS (appended by the data preparation), while a prompt for a model that was trained with a
    leading BOS (Llama) asks for `add_special_tokens=True`, which applies the tokenizer's own
    rule (a sentencepiece BOS, or a Hugging Face post-processor).
    """

    path: str  # as the user gave it; recorded in a prepared source's metadata.json
    sha256: str  # of the file(s) that define it: prepared data records it

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(
        self, texts: Sequence[str], *, add_special_tokens: bool = False
    ) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...
