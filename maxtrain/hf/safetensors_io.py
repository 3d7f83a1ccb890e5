"""Reading and writing Hugging Face safetensors directories one tensor at a time.

Reading uses the `safetensors` package's numpy API with the `pread` backend: each tensor is
read into its own array when asked for, and no file is memory-mapped, so a converter holds the
tensor it is working on and nothing else of the input. numpy has no bfloat16; importing
ml_dtypes registers one, which safetensors' numpy API then returns for BF16 tensors.

Writing is our own, because the package's writers take every tensor of a file at once: the
safetensors format is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, byte offsets into the data; plus `__metadata__`), and the raw little-endian tensor bytes
in that order. Every shape is known before the first byte, so the header is written first and
each tensor is produced, written and dropped in turn. Files beyond `max_shard_bytes` are split
into model-0000i-of-0000n.safetensors with a model.safetensors.index.json, as transformers does.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from maxtrain.hf.errors import ConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_CODES = {
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float16): "F16",
}
_FLOAT_CODES = set(DTYPE_CODES.values())


class TensorReader(contextlib.ExitStack):
    """The tensors of a Hugging Face model directory: model.safetensors, or the shards that
    model.safetensors.index.json lists. Use as a context manager (files are closed on exit)."""

    def __init__(self, hf_dir: Path):
        super().__init__()
        self._handles: dict[Path, safe_open] = {}
        index, single = hf_dir / INDEX_FILE, hf_dir / SINGLE_FILE
        if index.is_file():
            self.listing = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: not a safetensors index ({e!r})") from None
            self.files = {name: hf_dir / file for name, file in weight_map.items()}
        elif single.is_file():
            self.listing = single
            self.files = dict.fromkeys(self._open(single).keys(), single)
        else:
            raise ConversionError(
                f"{hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                "checkpoints are read)"
            )

    def _open(self, path: Path) -> safe_open:
        if path not in self._handles:
            if not path.is_file():
                raise ConversionError(f"{self.listing}: lists {path.name}, which does not exist")
            try:
                handle = safe_open(path, framework="numpy", backend="pread")
            except (SafetensorError, OSError) as e:
                raise ConversionError(f"{path}: not a readable safetensors file ({e})") from None
            self._handles[path] = self.enter_context(handle)
        return self._handles[path]

    def read(self, name: str, shape: tuple[int, ...], why: str) -> np.ndarray:
        """Tensor `name` (one of self.files), checked to have `shape` (why: what implies that
        shape, for messages) and a floating-point dtype."""
        path = self.files[name]
        handle = self._open(path)
        if name not in handle.keys():
            raise ConversionError(f"{path}: no tensor {name!r} ({self.listing.name} lists it)")
        view = handle.get_slice(name)
        found, dtype = tuple(view.get_shape()), view.get_dtype()
        if found != tuple(shape):
            raise ConversionError(
                f"{path}: tensor {name!r} has shape {list(found)}; {why} implies {list(shape)}"
            )
        if dtype not in _FLOAT_CODES:
            raise ConversionError(
                f"{path}: tensor {name!r} has dtype {dtype}; expected one of "
                f"{', '.join(sorted(_FLOAT_CODES))}"
            )
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as e:  # e.g. a truncated file
            raise ConversionError(f"{path}: cannot read tensor {name!r} ({e})") from None


@dataclass(frozen=True)
class OutputTensor:
    """A tensor to write: its name, shape and dtype up front, its values produced on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_safetensors(
    directory: Path, tensors: Iterable[OutputTensor], max_shard_bytes: int
) -> list[Path]:
    """Writes the tensors into `directory` (which must exist), splitting into shards of at most
    max_shard_bytes each (a larger tensor gets a shard of its own); returns the files written."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
    for name, shard in zip(names, shards, strict=True):
        _write_file(directory / name, shard)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
            "weight_map": {
                t.name: n for n, shard in zip(names, shards, strict=True) for t in shard
            },
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / n for n in names]


def _write_file(path: Path, tensors: list[OutputTensor]) -> None:
    assert sys.byteorder == "little", "safetensors data is little-endian"
    # transformers refuses a file whose metadata does not name the framework it was saved from.
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": DTYPE_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps the tensor data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors:
            array = np.ascontiguousarray(t.produce(), dtype=t.dtype)
            if array.shape != t.shape:
                raise ValueError(f"{t.name}: produced shape {array.shape}, planned {t.shape}")
            f.write(array.reshape(-1).view(np.uint8))
