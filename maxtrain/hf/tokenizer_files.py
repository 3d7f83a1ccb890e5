"""The tokenizer files of an exported model: what a Hugging Face user needs to generate text.

An export holds the weights and config.json; to tokenize and to stop generating, transformers
also wants the tokenizer and the special ids, in config.json and in `generation_config.json`.
A sentencepiece model goes as `tokenizer.model` plus a `tokenizer_config.json` (the layout its
Llama tokenizer reads); a Hugging Face `tokenizer.json` goes as it came, with the token files
beside it. The tokenizer is the run's: the one its data was prepared with, found from the config
saved with the checkpoint (the default model for the embedded corpus, else the `tokenizer`
recorded in the first source's shard metadata), or given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from sentencepiece import sentencepiece_model_pb2

from maxtrain.config import DataConfig
from maxtrain.data.shards import data_tokenizer
from maxtrain.tokenizers import TOKENIZER_FILES, load_tokenizer
from maxtrain.tokenizers.sentencepiece import SentencePieceTokenizer


def run_tokenizer(config_yaml: str) -> Path | None:
    """The sentencepiece model of the run whose resolved config this is; None when it is not
    known (a config without a data section, as an imported checkpoint's; synthetic or
    Megatron data; shards whose metadata is gone)."""
    data = (yaml.safe_load(config_yaml) or {}).get("data")
    if not isinstance(data, dict):
        return None
    try:
        return data_tokenizer(DataConfig.model_validate(data))
    except ValueError:  # pydantic's ValidationError: a config of another version
        return None


def special_ids(tokenizer_path: Path) -> dict[str, int]:
    """{bos_token_id, eos_token_id} of a tokenizer (bos left out if it has none)."""
    tokenizer = load_tokenizer(tokenizer_path)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    return {k: v for k, v in ids.items() if v >= 0}


def tokenizer_files(tokenizer_path: Path, max_length: int) -> dict[str, str | bytes]:
    """{file name: content} of the tokenizer and generation config to write beside the
    weights."""
    tokenizer = load_tokenizer(tokenizer_path)
    ids = special_ids(tokenizer_path)
    if not isinstance(tokenizer, SentencePieceTokenizer):  # tokenizer.json and its files
        directory = Path(tokenizer.path).parent
        files: dict[str, str | bytes] = {
            name: (directory / name).read_bytes()
            for name in TOKENIZER_FILES
            if (directory / name).is_file()
        }
        return {**files, "generation_config.json": json.dumps(ids, indent=2) + "\n"}
    processor = tokenizer.processor
    pieces: dict[str, Any] = {"eos_token": processor.id_to_piece(ids["eos_token_id"])}
    if "bos_token_id" in ids:
        pieces["bos_token"] = processor.id_to_piece(ids["bos_token_id"])
    if processor.unk_id() >= 0:
        pieces["unk_token"] = processor.id_to_piece(processor.unk_id())
    config = {
        "tokenizer_class": "LlamaTokenizer",  # transformers' plain sentencepiece tokenizer
        **pieces,
        "add_bos_token": False,  # documents were encoded without one; EOS ends each
        "add_eos_token": False,
        # Whether a space is put before the text, as the model says: transformers' Llama
        # tokenizer assumes it is (Llama's model does) unless told, and "The" became "▁The".
        "add_prefix_space": adds_dummy_prefix(tokenizer_path),
        "legacy": False,  # transformers' sentencepiece-faithful handling of text after specials
        # Text that spells a special token ("<s>", "</s>", "<unk>" in web or code data) is text:
        # sentencepiece never encodes it as the control id, so the model was trained on its
        # pieces. transformers would match it as the token unless told (docs/huggingface.md).
        "split_special_tokens": True,
        "model_max_length": max_length,
    }
    return {
        "tokenizer.model": tokenizer_path.read_bytes(),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "generation_config.json": json.dumps(ids, indent=2) + "\n",
    }


def adds_dummy_prefix(model_path: Path) -> bool:
    """Whether a sentencepiece model puts a space before every text it encodes (its normalizer's
    add_dummy_prefix). maxtrain's default tokenizer does not: "The" is one piece, not "▁The"."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    return proto.normalizer_spec.add_dummy_prefix
