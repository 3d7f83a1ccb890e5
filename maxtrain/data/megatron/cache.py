"""Index arrays built once and kept on disk, like Megatron's `{md5}-GPTDataset-...npy` files.

Building a large corpus's indices (a shuffle over every document and sample, the blend's
greedy fill) takes minutes, and a restart needs exactly the same arrays, so they are cached.
The key is the MD5 of a JSON description of everything the arrays depend on (the corpus files'
sizes and mtimes, the split, the sample count, the sequence length, the seed, the weights).

Every file is written under a temporary name and renamed; the description file is renamed
last and marks the set complete, so a crash never leaves a half-written index that a later run
would trust. Two processes building the same key at once write identical files; either rename
wins. Arrays are opened memory-mapped, and pickle as their paths (grain worker processes map
the same files instead of receiving copies).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from maxtrain.common.files import write_atomic
from maxtrain.data.errors import DataError

VERSION = 1  # bump when the arrays a description maps to change


class MappedArrays(Mapping[str, np.ndarray]):
    """{name: array} memory-mapped from .npy files, opened on first use."""

    def __init__(self, paths: Mapping[str, Path]):
        self.paths = dict(paths)
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = np.load(self.paths[name], mmap_mode="r")
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __reduce__(self):
        return MappedArrays, (self.paths,)


def file_identity(path: Path) -> dict[str, Any]:
    """What a cached index of this file depends on: where it is, its size and its mtime."""
    stat = path.stat()
    return {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cached(
    cache_dir: Path,
    kind: str,
    description: dict[str, Any],
    build: Callable[[], Mapping[str, np.ndarray]],
) -> MappedArrays:
    """The arrays `build()` returns for this description, from the cache or built and saved."""
    text = json.dumps({"version": VERSION, "kind": kind, **description}, indent=1, sort_keys=True)
    stem = f"{hashlib.md5(text.encode()).hexdigest()}-{kind}"
    marker = cache_dir / f"{stem}-description.json"
    if marker.is_file():
        names = json.loads(marker.read_text())["arrays"]
        return MappedArrays({n: cache_dir / f"{stem}-{n}.npy" for n in names})
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the index cache {cache_dir} (data.cache_dir): {e}") from e
    arrays = build()
    paths = {name: cache_dir / f"{stem}-{name}.npy" for name in arrays}
    for name, array in arrays.items():
        write_atomic(paths[name], lambda f, a=array: np.save(f, a, allow_pickle=False), fsync=True)
    record = {**json.loads(text), "arrays": list(arrays)}
    write_atomic(marker, json.dumps(record, indent=1), fsync=True)
    return MappedArrays(paths)
