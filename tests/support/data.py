"""Data on disk for tests: token shards with known documents, mixtures of them, prepared text
sources, and the data tools loaded as modules."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from maxtrain.data import shards
from maxtrain.data.corpora import embedded
from maxtrain.data.shards import write_shards
from maxtrain.tokenizers import load_tokenizer

TOKENIZER = embedded.DEFAULT_TOKENIZER
EOS = 1  # token 0 is what the packers pad with; documents never hold it

BIG_VOCAB = 1 << 20  # pipeline-only tests use unique token ids; no model is built


def write_source(out: Path, docs: list[list[int]], vocab_size: int, docs_per_shard: int = 40):
    """A prepared source as tools/prepare_data.py writes it: shards of int32 + EOS,
    metadata."""
    out.mkdir(parents=True, exist_ok=True)
    listed = []
    for start in range(0, len(docs), docs_per_shard):
        name = f"shard-{len(listed):05d}{shards.SHARD_SUFFIX}"
        writer = ArrayRecordWriter(str(out / name), "group_size:1")
        chunk = docs[start : start + docs_per_shard]
        for doc in chunk:
            writer.write(shards.encode_record(doc, EOS))
        writer.close()
        tokens = sum(len(d) + 1 for d in chunk)
        listed.append({"file": name, "documents": len(chunk), "tokens": tokens})
    metadata = {
        "format": shards.FORMAT,
        "tokenizer": "test",
        "tokenizer_sha256": "test",
        "vocab_size": vocab_size,
        "eos_id": EOS,
        "bos_id": -1,
        "documents": len(docs),
        "tokens": sum(s["tokens"] for s in listed),
        "shards": listed,
        "skipped": {},
        "inputs": [],
    }
    (out / shards.METADATA).write_text(json.dumps(metadata))
    return out


def random_docs(seed: int, n: int, lengths: tuple[int, int], first_id: int) -> list[list[int]]:
    """n documents of random lengths whose token ids are unique, counting up from first_id."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], first_id
    for length in rng.integers(*lengths, size=n):
        docs.append(list(range(next_id, next_id + int(length))))
        next_id += int(length)
    return docs


def sources_override(specs: list[tuple[str, Path, float]]) -> str:
    return "data.sources=" + json.dumps(
        [{"name": n, "path": str(p), "weight": w} for n, p, w in specs]
    )


# The package module each tools/<name>.py script runs: tests call it, never the script.
TOOL_MODULES = {
    "benchmark": "maxtrain.benchmarks.step",
    "benchmark_data": "maxtrain.benchmarks.data_pipeline",
    "prepare_data": "maxtrain.data.prepare",
    "quantize": "maxtrain.quantization.cli",
    "show_data": "maxtrain.data.show",
    "train_tokenizer": "maxtrain.tokenizers.train",
}


def load_tool(name: str) -> ModuleType:
    """The package module behind tools/<name>.py (its main(argv) is the script's)."""
    return importlib.import_module(TOOL_MODULES[name])


def prepared(tmp_path: Path, docs: list[str], name: str = "src", **kwargs) -> Path:
    out = tmp_path / name
    write_shards(docs, load_tokenizer(TOKENIZER), out, **kwargs)
    return out
