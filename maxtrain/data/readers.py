"""Documents (str) from text, JSONL and Parquet files, with every skipped record counted.

prepare_data.py and train_tokenizer.py both read corpora through `DocumentReader`, so a
tokenizer is trained on exactly the documents that are later tokenized. A record that cannot
become a document (bytes that are not UTF-8, a line that is not JSON, a missing or non-string
field, empty text) is skipped and counted by reason in `DocumentReader.skipped`, which also
keeps where the first few of each reason were (`file:line`); the tools print both, so the data
never changes silently and a bad record can be found. Mistakes that make the input as a whole
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

from maxtrain.common.errors import first_line
from maxtrain.data.errors import DataError

Format = Literal["auto", "txt", "jsonl", "parquet"]
TxtSplit = Literal["file", "paragraph"]

FORMATS = ("txt", "jsonl", "parquet")
_SUFFIX_FORMAT = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_BLANK_LINES = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")  # a paragraph break: one or more blank lines


class Skipped(Counter):
    """Skipped records counted by reason; `where[reason]`: the first few places (file:line for
    JSONL, file:row for Parquet, the file for text), to find them by."""

    EXAMPLES = 3

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[str, list[str]] = {}

    def add(self, reason: str, where: str) -> None:
        self[reason] += 1
        places = self.where.setdefault(reason, [])
        if len(places) < self.EXAMPLES:
            places.append(where)

    def describe(self) -> str:
        """'invalid-json 2 (a.jsonl:3, a.jsonl:7), ...' or 'none'."""
        parts = []
        for reason, count in sorted(self.items()):
            more = ", ..." if count > len(self.where.get(reason, [])) else ""
            parts.append(f"{reason} {count:,} ({', '.join(self.where.get(reason, []))}{more})")
        return ", ".join(parts) or "none"


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
        self.skipped = Skipped()

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


def _txt_documents(path: Path, split: TxtSplit, skipped: Skipped) -> Iterator[str]:
    data = path.read_bytes()
    if split == "file":
        blocks = [data]
    else:  # blank runs around and between paragraphs are separators, not records
        blocks = [b.strip(b"\r\n") for b in _BLANK_LINES.split(data)]
        blocks = [b for b in blocks if b.strip()]
    for number, block in enumerate(blocks, 1):
        where = f"{path}" if split == "file" else f"{path} paragraph {number}"
        text = _decode(block, skipped, where)
        if text is not None and _has_text(text, skipped, where):
            yield text


def _jsonl_documents(path: Path, field: str, skipped: Skipped) -> Iterator[str]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            where = f"{path}:{number}"
            if not line.strip():
                skipped.add("blank-line", where)
                continue
            text = _decode(line, skipped, where)
            if text is None:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                skipped.add("invalid-json", where)
                continue
            value = _field_text(record, field, skipped, where)
            if value is not None and _has_text(value, skipped, where):
                yield value


def _field_text(record: object, field: str, skipped: Skipped, where: str) -> str | None:
    value = record.get(field) if isinstance(record, dict) else None
    if value is None:
        skipped.add("missing-field", where)
        return None
    if not isinstance(value, str):
        skipped.add("non-string-field", where)
        return None
    try:  # JSON escapes can make lone surrogates, which have no UTF-8 form to tokenize
        value.encode("utf-8")
    except UnicodeEncodeError:
        skipped.add("non-utf8", where)
        return None
    return value


def _parquet_documents(path: Path, column: str, skipped: Skipped) -> Iterator[str]:
    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise DataError(f"{path} has no column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"column {column!r} of {path} has type {kind}, not string")
    row = 0
    for group in range(parquet.num_row_groups):
        for value in parquet.read_row_group(group, columns=[column]).column(0).to_pylist():
            row, where = row + 1, f"{path} row {row + 1}"
            if value is None:
                skipped.add("missing-field", where)
            elif _has_text(value, skipped, where):
                yield value


def _decode(data: bytes, skipped: Skipped, where: str) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        skipped.add("non-utf8", where)
        return None


def _has_text(text: str, skipped: Skipped, where: str) -> bool:
    if text.strip():
        return True
    skipped.add("empty-text", where)
    return False
