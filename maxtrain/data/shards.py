"""Prepared sources: tokenized ArrayRecord shards plus metadata.json, written and checked.

The format ("maxtrain-tokens-v1") is the contract between tools/prepare_data.py and the
training pipeline. A prepared source is a directory of `shard-NNNNN.arrayrecord` files and a
`metadata.json`. Each record is one document: its token ids as little-endian int32 with the
tokenizer's EOS id appended, so documents stay delimited after the pipeline concatenates them.
Group size 1 keeps every record addressable by index, which is how grain reads.

metadata.json is written last and is the completeness marker: shards are written as `.tmp` and
renamed once closed and synced, a failed run deletes what it wrote, and a directory without
metadata.json is never treated as a prepared source.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from maxtrain.common.errors import first_line
from maxtrain.common.files import write_atomic
from maxtrain.data.errors import DataError
from maxtrain.tokenizers import DEFAULT_TOKENIZER, Tokenizer

FORMAT = "maxtrain-tokens-v1"
METADATA = "metadata.json"
SHARD_SUFFIX = ".arrayrecord"
TOKEN_DTYPE = np.dtype("<i4")  # every record: [len(doc) + 1] little-endian int32, EOS last
_WRITER_OPTIONS = "group_size:1"
_ENCODE_BATCH = 256  # documents per tokenizer call (both kinds tokenize a batch on all cores)


def encode_record(ids: Sequence[int], eos_id: int) -> bytes:
    return np.asarray([*ids, eos_id], TOKEN_DTYPE).tobytes()


def decode_record(record: bytes) -> np.ndarray:
    """[n] int32 token ids of one document, its EOS last."""
    return np.frombuffer(record, TOKEN_DTYPE)


def read_shard(path: Path) -> list[np.ndarray]:
    """Every document of one shard, in order (for checks and statistics, not for training)."""
    reader = ArrayRecordReader(str(path))
    try:
        return [decode_record(r) for r in reader.read_all()]
    finally:
        reader.close()


def write_shards(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    out_dir: Path,
    *,
    docs_per_shard: int = 10_000,
    tokens_per_shard: int | None = None,
    inputs: Sequence[str] = (),
    skipped: Mapping[str, int] | None = None,
    overwrite: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenizes `docs` into a prepared source in out_dir; returns its metadata.

    A shard closes at `docs_per_shard` documents or, if given, once it holds `tokens_per_shard`
    tokens. `skipped` is read after `docs` is exhausted, so a reader's live counter works.
    `on_progress(documents, tokens)` gets the increments after each batch. On any failure the
    files this call wrote are removed, and out_dir too if this call created it.
    """
    writer = _ShardWriter(out_dir, docs_per_shard, tokens_per_shard)  # checks the sizes first
    created = _prepare_output(out_dir, overwrite)
    try:
        for batch in itertools.batched(docs, _ENCODE_BATCH):
            encoded = tokenizer.encode(batch)
            for ids in encoded:
                writer.add(encode_record(ids, tokenizer.eos_id), len(ids) + 1)
            if on_progress is not None:
                on_progress(len(encoded), sum(len(ids) + 1 for ids in encoded))
        shards = writer.finish()
        skips = dict(sorted((skipped or {}).items()))
        if not shards:
            raise DataError(f"no documents to write to {out_dir}; skipped: {_describe(skips)}")
        metadata = _metadata(tokenizer, shards, skips, inputs)
        write_atomic(out_dir / METADATA, json.dumps(metadata, indent=1) + "\n", fsync=True)
    except BaseException:
        writer.abort()
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return metadata


def _metadata(
    tokenizer: Tokenizer, shards: list[dict], skipped: dict[str, int], inputs: Sequence[str]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "tokenizer": tokenizer.path,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),  # EOS included: what the pipeline reads
        "shards": shards,
        "skipped": skipped,
        "inputs": [str(i) for i in inputs],
    }


def _prepare_output(out_dir: Path, overwrite: bool) -> Path | None:
    """Makes out_dir ready; returns the topmost directory it had to create (None if none)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {out_dir} exists and is not a directory")
    old_shards = [*out_dir.glob(f"*{SHARD_SUFFIX}"), *out_dir.glob(f"*{SHARD_SUFFIX}.tmp")]
    if not overwrite and (out_dir / METADATA).exists():
        raise DataError(
            f"{out_dir} already holds a prepared source; pass --overwrite to replace it"
        )
    if not overwrite and old_shards:
        raise DataError(
            f"{out_dir} holds {len(old_shards)} shard files but no {METADATA} (an interrupted "
            "run?); pass --overwrite to replace them"
        )
    (out_dir / METADATA).unlink(missing_ok=True)  # the completeness marker goes first
    for old in old_shards:
        old.unlink()
    created = next((p for p in [out_dir, *out_dir.parents][::-1] if not p.exists()), None)
    out_dir.mkdir(parents=True, exist_ok=True)
    return created


class _ShardWriter:
    """Writes records into shard-NNNNN.arrayrecord.tmp files, renaming each once it is full."""

    def __init__(self, out_dir: Path, docs_per_shard: int, tokens_per_shard: int | None):
        if docs_per_shard < 1 or (tokens_per_shard is not None and tokens_per_shard < 1):
            raise DataError("docs_per_shard and tokens_per_shard must be at least 1")
        self.out_dir, self.max_docs, self.max_tokens = out_dir, docs_per_shard, tokens_per_shard
        self.done: list[dict] = []
        self.writer: ArrayRecordWriter | None = None
        self.docs = self.tokens = 0

    def _tmp_path(self) -> Path:
        return self.out_dir / f"shard-{len(self.done):05d}{SHARD_SUFFIX}.tmp"

    def add(self, record: bytes, tokens: int) -> None:
        if self.writer is None:
            self.writer = ArrayRecordWriter(str(self._tmp_path()), _WRITER_OPTIONS)
        self.writer.write(record)
        self.docs, self.tokens = self.docs + 1, self.tokens + tokens
        if self.docs >= self.max_docs or (self.max_tokens and self.tokens >= self.max_tokens):
            self._close_shard()

    def _close_shard(self) -> None:
        self.writer.close()
        tmp = self._tmp_path()
        final = tmp.with_suffix("")  # drop ".tmp"
        _fsync(tmp)
        os.replace(tmp, final)
        self.done.append({"file": final.name, "documents": self.docs, "tokens": self.tokens})
        self.writer, self.docs, self.tokens = None, 0, 0

    def finish(self) -> list[dict]:
        if self.writer is not None:
            self._close_shard()
        return self.done

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._tmp_path().unlink(missing_ok=True)
        for shard in self.done:
            (self.out_dir / shard["file"]).unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _describe(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "nothing"


def read_metadata(source_dir: str | Path) -> dict[str, Any]:
    """metadata.json of a prepared source; DataError if it is missing, unreadable or not ours."""
    path = Path(source_dir) / METADATA
    if not path.is_file():
        raise DataError(
            f"{source_dir} has no {METADATA}: not a prepared source (or an interrupted "
            "tools/prepare_data.py run)"
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from e
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise DataError(f"{path} is not a {FORMAT} metadata file")
    return metadata


@dataclass(frozen=True)
class SourceInfo:
    shards: list[Path]  # sorted, every one checked
    metadata: dict[str, Any]  # of the first shard's directory; all share one tokenizer
    documents: int  # over the matched shards only
    tokens: int


def validate_source(spec: str | Path) -> SourceInfo:
    """Checks the shards a directory or glob names; DataError naming the first bad file.

    Each shard must be listed in its directory's metadata.json with the same record count,
    open as an ArrayRecord file, and have a readable, well-formed first and last record. Shards
    from directories prepared with different tokenizers may not be mixed.
    """
    shards = _match_shards(spec)
    metadatas = {d: read_metadata(d) for d in sorted({s.parent for s in shards})}
    if len({m["tokenizer_sha256"] for m in metadatas.values()}) > 1:
        raise DataError(f"{spec} matches shards made with different tokenizers")
    documents = tokens = 0
    for shard in shards:
        metadata = metadatas[shard.parent]
        listed = {s["file"]: s for s in metadata["shards"]}.get(shard.name)
        if listed is None:
            raise DataError(f"{shard} is not listed in its {METADATA} (a leftover of another run?)")
        _check_shard(shard, listed["documents"], metadata["eos_id"])
        documents, tokens = documents + listed["documents"], tokens + listed["tokens"]
    return SourceInfo(shards, next(iter(metadatas.values())), documents, tokens)


def _match_shards(spec: str | Path) -> list[Path]:
    pattern = os.path.join(spec, f"*{SHARD_SUFFIX}") if Path(spec).is_dir() else str(spec)
    shards = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    shards = [p for p in shards if p.name.endswith(SHARD_SUFFIX) and p.is_file()]
    if not shards:
        raise DataError(f"no {SHARD_SUFFIX} shards match {str(spec)!r}")
    return shards


def _check_shard(path: Path, expected_records: int, eos_id: int) -> None:
    try:
        records = _first_and_last_record(path, expected_records)
    except RuntimeError as e:
        raise DataError(f"corrupt ArrayRecord file {path}: {first_line(e)}") from e
    for record in records:
        if len(record) % TOKEN_DTYPE.itemsize or not record or decode_record(record)[-1] != eos_id:
            raise DataError(f"corrupt shard {path}: a record is not int32 tokens ending in EOS")


def _first_and_last_record(path: Path, expected_records: int) -> list[bytes]:
    reader = ArrayRecordReader(str(path))
    if not reader.ok():  # closing a reader that failed to open raises, so it is left as is
        raise DataError(f"corrupt ArrayRecord file {path}: it does not open")
    try:
        count = reader.num_records()
        if count == 0:
            raise DataError(f"empty shard {path}: it holds no records")
        if count != expected_records:
            raise DataError(f"{path} holds {count} records; its {METADATA} says {expected_records}")
        return reader.read([0, count - 1])
    finally:
        reader.close()


def check_vocab(metadata: Mapping[str, Any], model_vocab_size: int) -> None:
    """DataError if the source's tokenizer makes ids the model's embedding cannot hold."""
    if metadata["vocab_size"] > model_vocab_size:
        raise DataError(
            f"tokenizer {metadata['tokenizer']} has a vocab of {metadata['vocab_size']}, larger "
            f"than the model's vocab_size {model_vocab_size}; train on data prepared with the "
            "model's own tokenizer (python tools/prepare_data.py ... --tokenizer "
            "TOKENIZER: docs/data.md), or give the model model.vocab_size="
            f"{metadata['vocab_size']} or more"
        )


def data_tokenizer(data: Any) -> Path | None:
    """The sentencepiece model the data config's sources were tokenized with: the default one
    for the embedded corpus, else the `tokenizer` in the first source's metadata.json. None
    when it is not known (synthetic or Megatron data, a source whose metadata or tokenizer file
    is gone). data: a DataConfig."""
    if data.kind != "grain" or not data.sources:
        return None
    if data.sources[0].format != "tokens":  # chat or preference text, tokenized as it is read
        return Path(data.tokenizer) if data.tokenizer else DEFAULT_TOKENIZER
    path = data.sources[0].path
    if path.startswith("embedded:"):
        return DEFAULT_TOKENIZER
    directory = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        recorded = read_metadata(directory).get("tokenizer")
    except (DataError, OSError):
        return None
    return Path(recorded) if recorded and Path(recorded).is_file() else None
