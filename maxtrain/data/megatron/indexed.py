"""Megatron-LM's indexed dataset: the `PREFIX.bin` / `PREFIX.idx` pair, read and written.

This is the format Megatron's `preprocess_data.py` and `IndexedDatasetBuilder` write, read here
with numpy alone (no torch, no Megatron). `PREFIX.idx`, little-endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    <Q        version, 1
    <B        dtype code of the tokens (DTYPES below)
    <Q        sequence count n
    <Q        document count d (the document indices below, so documents + 1)
    int32[n]  sequence lengths, in tokens
    int64[n]  byte offset of each sequence in PREFIX.bin
    int64[d]  document indices: the sequence each document starts at, from 0, ending with n
    int8[n]   sequence modes (multimodal corpora only; no header flag says so)

`PREFIX.bin` is the tokens of every sequence back to back, no header. A sequence is what
Megatron's GPTDataset samples from; without `--split-sentences` one document is one sequence.

Opening a corpus checks everything that costs O(1) or one pass over the small index: both halves
present, magic, version, dtype code, the .idx size against its counts, and the .bin size against
the last sequence. A mismatch is a DataError naming the file, never a crash halfway into a run.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from maxtrain.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPES: dict[int, np.dtype] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32",
        5: "int64", 6: "float64", 7: "float32", 8: "uint16",
    }.items()
}  # fmt: skip
# preprocess_data.py stores uint16 tokens below this vocabulary size, int32 from it on.
UINT16_VOCAB_LIMIT = 65_500


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocess_data.py picks for a vocabulary of this size."""
    return DTYPES[8] if vocab_size < UINT16_VOCAB_LIMIT else DTYPES[4]


@dataclass(frozen=True)
class IndexedCorpus:
    """One opened corpus: its index arrays and tokens, memory-mapped (nothing is read yet).

    Pickles as its prefix and reopens on the other side, so grain worker processes share the
    page cache instead of receiving copies of the arrays.
    """

    prefix: str
    sequence_lengths: np.ndarray  # [n] int32
    sequence_pointers: np.ndarray  # [n] int64, byte offsets into PREFIX.bin
    document_indices: np.ndarray  # [documents + 1] int64
    tokens: np.ndarray  # [total tokens] of the stored dtype

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    def token_offsets(self, sequences: np.ndarray) -> np.ndarray:
        """The index in `tokens` of each given sequence's first token."""
        return self.sequence_pointers[sequences] // self.tokens.dtype.itemsize

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.tokens.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    def __reduce__(self):
        return open_corpus, (self.prefix,)


def open_corpus(prefix: str | Path) -> IndexedCorpus:
    """Opens PREFIX.idx / PREFIX.bin after checking them; DataError naming the bad file."""
    idx, bin_ = idx_path(prefix), bin_path(prefix)
    for path, other in ((idx, bin_), (bin_, idx)):
        if not path.is_file():
            found = f"{other.name} exists but " if other.is_file() else ""
            raise DataError(
                f"{path} not found: {found}a Megatron corpus is the pair PREFIX.bin / PREFIX.idx"
            )
    idx_size = idx.stat().st_size
    if idx_size < HEADER.size:
        raise DataError(f"{idx} is {idx_size} bytes, too short for a Megatron index header")
    with idx.open("rb") as f:
        magic, version, code, n, d = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise DataError(f"{idx} is not a Megatron index: it starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise DataError(f"{idx} has index version {version}; only version {VERSION} exists")
    if code not in DTYPES:
        raise DataError(f"{idx} has token dtype code {code}; known codes are {sorted(DTYPES)}")
    arrays_size = HEADER.size + 12 * n + 8 * d
    if idx_size not in (arrays_size, arrays_size + n):  # + n: the multimodal modes
        raise DataError(
            f"{idx} is {idx_size} bytes, but its header's {n} sequences and {d} document "
            f"indices need {arrays_size}: the file is truncated or its counts are wrong"
        )
    raw = np.memmap(idx, mode="r")
    lengths = np.frombuffer(raw, "<i4", n, HEADER.size)
    pointers = np.frombuffer(raw, "<i8", n, HEADER.size + 4 * n)
    documents = np.frombuffer(raw, "<i8", d, HEADER.size + 12 * n)
    if d == 0 or documents[0] != 0 or documents[-1] != n or np.any(np.diff(documents) < 0):
        raise DataError(f"{idx}: the document indices must rise from 0 to the sequence count {n}")
    if n and (lengths.min() < 0 or pointers[0] != 0):
        raise DataError(f"{idx}: a negative sequence length or a first offset other than 0")
    dtype = DTYPES[code]
    expected_bin = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if n else 0
    bin_size = bin_.stat().st_size
    if bin_size != expected_bin:
        raise DataError(
            f"{bin_} is {bin_size} bytes, but {idx.name} places its last sequence to end at "
            f"byte {expected_bin} ({dtype.name} tokens): the pair does not belong together"
        )
    tokens = np.memmap(bin_, dtype, mode="r") if bin_size else np.empty(0, dtype)
    return IndexedCorpus(str(prefix), lengths, pointers, documents, tokens)


class IndexedWriter:
    """Writes a corpus Megatron's IndexedDataset reads, one document (= one sequence) at a time.

    Tokens stream to PREFIX.bin.tmp; `finish()` writes PREFIX.idx.tmp and renames both, the
    index last, so a PREFIX.idx that exists always belongs to a whole PREFIX.bin. `abort()`
    removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"Megatron stores no {dtype} tokens")
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self._bin_tmp = _tmp(bin_path(prefix))
        self._idx_tmp = _tmp(idx_path(prefix))
        self._file = self._bin_tmp.open("wb")
        self._lengths: list[int] = []

    def add_document(self, tokens: np.ndarray) -> None:
        array = np.asarray(tokens)
        stored = array.astype(self.dtype)
        if not np.array_equal(stored, array):
            raise DataError(f"{self.prefix}: token ids do not fit its {self.dtype.name} tokens")
        self._file.write(stored.tobytes())
        self._lengths.append(len(stored))

    def finish(self) -> None:
        self._file.close()
        lengths = np.asarray(self._lengths, "<i4")
        pointers = np.zeros(len(lengths), "<i8")
        np.cumsum(lengths[:-1] * np.int64(self.dtype.itemsize), out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype="<i8")
        code = next(c for c, t in DTYPES.items() if t == self.dtype)
        with self._idx_tmp.open("wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, code, len(lengths), len(documents)))
            for array in (lengths, pointers, documents):
                f.write(array.tobytes())
        renames = [(self._bin_tmp, bin_path(self.prefix)), (self._idx_tmp, idx_path(self.prefix))]
        for tmp, final in renames:
            _fsync(tmp)
            os.replace(tmp, final)

    def abort(self) -> None:
        self._file.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)


def _tmp(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp")


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())
