"""Picks the tokenizer implementation from a path, and keeps a model's tokenizer with it."""

from __future__ import annotations

import shutil
from pathlib import Path

from maxtrain.tokenizers.base import Tokenizer, TokenizerError
from maxtrain.tokenizers.huggingface import ID_FILES, TOKEN_FILES, TOKENIZER_JSON, load_huggingface
from maxtrain.tokenizers.sentencepiece import load_sentencepiece

SENTENCEPIECE_MODEL = "tokenizer.model"  # the name Hugging Face repositories give it
TOKENIZER_MODELS = (TOKENIZER_JSON, SENTENCEPIECE_MODEL)  # in the order a directory is searched
# What a Hugging Face model directory holds about its tokenizer; an import copies these.
TOKENIZER_FILES = (*TOKENIZER_MODELS, *TOKEN_FILES, ID_FILES[0])


# The sentencepiece model maxtrain ships (BPE, 1024 pieces, byte fallback): the embedded
# corpus and the committed chat sets are tokenized with it.
DEFAULT_TOKENIZER = Path(__file__).parents[1] / "data" / "assets" / "default.model"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a sentencepiece `.model` file, a `tokenizer.json`, or a
    directory holding either (tokenizer.json preferred, as transformers prefers it). Every
    tokenizer must have an EOS token: it delimits documents and ends generation."""
    file = Path(path)
    if file.is_dir():
        found = [file / name for name in TOKENIZER_MODELS]
        found = [f for f in found if f.is_file()]
        if not found:
            raise TokenizerError(
                f"{path} holds no tokenizer ({TOKENIZER_JSON} or {SENTENCEPIECE_MODEL})"
            )
        file = found[0]
    elif not file.is_file():
        raise TokenizerError(f"tokenizer not found: {path}")
    if file.suffix == ".json":
        tokenizer = load_huggingface(file)
    else:
        tokenizer = load_sentencepiece(file)
    if tokenizer.eos_id < 0:
        raise TokenizerError(
            f"tokenizer {path} has no EOS token, which delimits documents and ends generation"
        )
    return tokenizer


def copy_tokenizer_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copies the tokenizer files a model directory holds into destination (an existing
    directory); returns their names (none if the model came without a tokenizer)."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(destination) / name)
            copied.append(name)
    return copied
