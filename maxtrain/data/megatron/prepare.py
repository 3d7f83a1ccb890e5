"""Text -> a Megatron `PREFIX.bin` / `PREFIX.idx` pair (`tools/prepare_data.py
--output-format
megatron`), so a corpus prepared on maxtrain's side feeds Megatron-LM too.

It writes what Megatron's `preprocess_data.py --append-eod` would for the same token ids: one
document per sequence, the tokenizer's EOS appended as the end-of-document token, uint16 tokens
below a 65,500-piece vocabulary and int32 from there on. The EOS id is the `data.megatron.eod_id`
a config reading the corpus should name.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from maxtrain.data.errors import DataError
from maxtrain.data.megatron.indexed import IndexedWriter, bin_path, idx_path, token_dtype
from maxtrain.tokenizers import Tokenizer

_ENCODE_BATCH = 256  # documents per sentencepiece call


def write_corpus(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    prefix: Path,
    *,
    skipped: Mapping[str, int] | None = None,
    overwrite: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenizes `docs` into PREFIX.bin / PREFIX.idx; returns a summary like write_shards'.

    PREFIX's directory is created if missing. An existing pair is refused unless `overwrite`; on
    any failure nothing is left behind (the old pair, if replaced, is only replaced by the final
    rename; a directory this call created is removed).
    """
    existing = [p for p in (bin_path(prefix), idx_path(prefix)) if p.exists()]
    if existing and not overwrite:
        raise DataError(f"{existing[0]} exists; pass --overwrite to replace it")
    parent = prefix.parent
    created = next((p for p in [parent, *parent.parents][::-1] if not p.exists()), None)
    try:
        parent.mkdir(parents=True, exist_ok=True)  # as the ArrayRecord output does
    except OSError as e:
        raise DataError(f"cannot create the output directory {parent}: {e.strerror or e}") from None
    try:
        writer = IndexedWriter(prefix, token_dtype(tokenizer.vocab_size))
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    documents = tokens = 0
    try:
        for batch in itertools.batched(docs, _ENCODE_BATCH):
            encoded = tokenizer.encode(batch)
            for ids in encoded:
                writer.add_document(np.array([*ids, tokenizer.eos_id]))
            added = sum(len(ids) + 1 for ids in encoded)
            documents, tokens = documents + len(encoded), tokens + added
            if on_progress is not None:
                on_progress(len(encoded), added)
        if not documents:
            raise DataError(f"no documents to write to {prefix}")
        writer.finish()
    except BaseException:
        writer.abort()
        if created is not None:  # a failed run leaves no directory it created
            shutil.rmtree(created, ignore_errors=True)
        raise
    return {
        "documents": documents,
        "tokens": tokens,  # EOS included
        "files": [str(bin_path(prefix)), str(idx_path(prefix))],
        "eod_id": tokenizer.eos_id,
        "skipped": dict(sorted((skipped or {}).items())),
    }
