"""Tokenizers: one small interface, a sentencepiece model or a Hugging Face `tokenizer.json`.

    tokenizer = load_tokenizer("maxtrain/data/assets/default.model")   # sentencepiece
    tokenizer = load_tokenizer("imported-checkpoint/")                 # tokenizer.json + configs
    ids = tokenizer.encode(["some text"])[0]; text = tokenizer.decode(ids)

Data preparation (tools/prepare_data.py), the embedded corpus, generation and evaluation
all take a `Tokenizer`; `load_tokenizer` is the one factory that picks the implementation from a
path.
"""

from maxtrain.tokenizers.base import Tokenizer, TokenizerError
from maxtrain.tokenizers.factory import (
    DEFAULT_TOKENIZER,
    TOKENIZER_FILES,
    TOKENIZER_MODELS,
    copy_tokenizer_files,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_TOKENIZER",
    "TOKENIZER_FILES",
    "TOKENIZER_MODELS",
    "Tokenizer",
    "TokenizerError",
    "copy_tokenizer_files",
    "load_tokenizer",
]
