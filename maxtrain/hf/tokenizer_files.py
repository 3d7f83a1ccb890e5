"""The tokenizer files of an exported model: what a Hugging Face user needs to generate text.

An export holds the weights and config.json; to tokenize and to stop generating, transformers
also wants the tokenizer (`tokenizer.model` plus `tokenizer_config.json`, the sentencepiece
layout its Llama tokenizer reads) and the special ids, in config.json and in
`generation_config.json`. The tokenizer is the run's: the sentencepiece model its data was
prepared with, found from the config saved with the checkpoint (the default model for the
embedded corpus, else the `tokenizer` recorded in the first source's shard metadata), or given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from maxtrain.config import DataConfig
from maxtrain.data.shards import data_tokenizer, load_tokenizer


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
    """{bos_token_id, eos_token_id} of a sentencepiece model (bos left out if it has none)."""
    processor = load_tokenizer(tokenizer_path).processor
    ids = {"bos_token_id": processor.bos_id(), "eos_token_id": processor.eos_id()}
    return {k: v for k, v in ids.items() if v >= 0}


def tokenizer_files(tokenizer_path: Path, max_length: int) -> dict[str, str | bytes]:
    """{file name: content} of the tokenizer and generation config to write beside the
    weights."""
    processor = load_tokenizer(tokenizer_path).processor
    ids = special_ids(tokenizer_path)
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
        "model_max_length": max_length,
    }
    return {
        "tokenizer.model": tokenizer_path.read_bytes(),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "generation_config.json": json.dumps(ids, indent=2) + "\n",
    }
