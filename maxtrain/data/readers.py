"""Documents (str) from text, JSONL and Parquet files, with every skipped record counted.

prepare_data.py and train_tokenizer.py both read corpora through `DocumentReader`, so a
tokenizer is trained on exactly the documents that are later tokenized. A record that cannot
become a document (bytes that are not UTF-8, a line that is not JSON, a missing or non-string
field, empty text) is skipped and counted by reason in `DocumentReader.skipped`; the tools
print the counts, so the data never changes silently. Mistakes that make the input as a whole
wrong (a glob that matches nothing, an unreadable file, a missing Parquet column) raise
DataError instead, before anything is written.

Formats, picked from the suffix unless given:
  .txt              one document per file, or per blank-line-separated block (txt_split="paragraph")
  .jsonl / .json    one JSON object per line; the document is its `field` (default "text")
  .parquet          the `field` column, read one row group at a time
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from maxtrain.data.errors import DataError
from maxtrain.errors import first_line

Format = Literal["auto", "txt", "jsonl", "parquet"]
TxtSplit = Literal["file", "paragraph"]

FORMATS = ("txt", "jsonl", "parquet")
_SUFFIX_FORMAT = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_BLANK_LINES = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")  # a paragraph break: one or more blank lines


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """The files the glob patterns match, sorted per pattern, first occurrence kept."""
    files: dict[Path, None] = {}
    for pattern in patterns:
        matches = [Path(m) for m in sorted(glob.glob(os.path.expanduser(pattern), recursive=True))]
        matched_files = [m for m in matches if m.is_file()]
        if not matched_files:
            hint = " (only directories; give a glob of files, e.g. 'DIR/*.jsonl')"
            raise DataError(f"no files match {pattern!r}{hint if matches else ''}")
        files.update(dict.fromkeys(matched_files))
    return list(files)


def detect_format(path: Path, fmt: Format = "auto") -> str:
    if fmt != "auto":
        return fmt
    try:
        return _SUFFIX_FORMAT[path.suffix.lower()]
    except KeyError:
        raise DataError(
            f"cannot tell the format of {path} from its suffix; pass --format txt|jsonl|parquet"
        ) from None


class DocumentReader:
    """Iterates the documents of glob patterns; `skipped` counts the records left out, by reason.

    Globs and formats are resolved here, at construction, so mistakes surface before any output.
    Iterating again reads the files again and keeps adding to `skipped`.
    """

    def __init__(
        self,
        patterns: Sequence[str],
        fmt: Format = "auto",
        field: str = "text",
        txt_split: TxtSplit = "file",
    ):
        self.files = expand_inputs(patterns)
        self.formats = [detect_format(f, fmt) for f in self.files]
        self.field, self.txt_split = field, txt_split
        self.skipped: Counter[str] = Counter()

    def __iter__(self) -> Iterator[str]:
        for path, fmt in zip(self.files, self.formats, strict=True):
            try:
                yield from self._documents(path, fmt)
            except (OSError, pa.ArrowException) as e:
                reason = getattr(e, "strerror", None) or e  # an OSError's, without the path again
                raise DataError(f"cannot read {path}: {first_line(reason)}") from e

    def _documents(self, path: Path, fmt: str) -> Iterator[str]:
        if fmt == "txt":
            return _txt_documents(path, self.txt_split, self.skipped)
        if fmt == "jsonl":
            return _jsonl_documents(path, self.field, self.skipped)
        return _parquet_documents(path, self.field, self.skipped)


def _txt_documents(path: Path, split: TxtSplit, skipped: Counter[str]) -> Iterator[str]:
    data = path.read_bytes()
    if split == "file":
        blocks = [data]
    else:  # blank runs around and between paragraphs are separators, not records
        blocks = [b.strip(b"\r\n") for b in _BLANK_LINES.split(data)]
        blocks = [b for b in blocks if b.strip()]
    for block in blocks:
        text = _decode(block, skipped)
        if text is not None and _has_text(text, skipped):
            yield text


def _jsonl_documents(path: Path, field: str, skipped: Counter[str]) -> Iterator[str]:
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                skipped["blank-line"] += 1
                continue
            text = _decode(line, skipped)
            if text is None:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                skipped["invalid-json"] += 1
                continue
            value = _field_text(record, field, skipped)
            if value is not None and _has_text(value, skipped):
                yield value


def _field_text(record: object, field: str, skipped: Counter[str]) -> str | None:
    value = record.get(field) if isinstance(record, dict) else None
    if value is None:
        skipped["missing-field"] += 1
        return None
    if not isinstance(value, str):
        skipped["non-string-field"] += 1
        return None
    try:  # JSON escapes can make lone surrogates, which have no UTF-8 form to tokenize
        value.encode("utf-8")
    except UnicodeEncodeError:
        skipped["non-utf8"] += 1
        return None
    return value


def _parquet_documents(path: Path, column: str, skipped: Counter[str]) -> Iterator[str]:
    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise DataError(f"{path} has no column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"column {column!r} of {path} has type {kind}, not string")
    for group in range(parquet.num_row_groups):
        for value in parquet.read_row_group(group, columns=[column]).column(0).to_pylist():
            if value is None:
                skipped["missing-field"] += 1
            elif _has_text(value, skipped):
                yield value


def _decode(data: bytes, skipped: Counter[str]) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        skipped["non-utf8"] += 1
        return None


def _has_text(text: str, skipped: Counter[str]) -> bool:
    if text.strip():
        return True
    skipped["empty-text"] += 1
    return False
