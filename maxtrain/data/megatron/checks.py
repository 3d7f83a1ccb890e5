"""What a Megatron corpus must hold for a given config: ids the model can embed, and EOD tokens
where the token-handling switches rely on them. Megatron itself checks neither; a wrong id
would index past the embedding table, a missing EOD would silently train without resets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from maxtrain.data.errors import DataError
from maxtrain.data.megatron.cache import cached, file_identity
from maxtrain.data.megatron.indexed import IndexedCorpus, bin_path

_SCAN_CHUNK = 1 << 26  # tokens per pass of the id scan (128 MiB of uint16)
EOD_PROBES = 1024  # documents whose last token is checked for the EOD id


def token_id_range(corpus: IndexedCorpus, cache_dir: Path) -> tuple[int, int]:
    """(smallest, largest) token id in the corpus: one pass over PREFIX.bin, cached by the
    file's identity, so a large corpus is scanned once per cache directory."""

    def scan() -> dict[str, np.ndarray]:
        lo, hi = 0, 0
        for start in range(0, len(corpus.tokens), _SCAN_CHUNK):
            chunk = corpus.tokens[start : start + _SCAN_CHUNK]
            lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
        return {"id_range": np.array([lo, hi], np.int64)}

    description = {"bin": file_identity(bin_path(corpus.prefix))}
    lo, hi = cached(cache_dir, "token-ids", description, scan)["id_range"]
    return int(lo), int(hi)


def check_vocab(corpus: IndexedCorpus, vocab_size: int, cache_dir: Path) -> None:
    """DataError unless every token id is in [0, vocab_size)."""
    lo, hi = token_id_range(corpus, cache_dir)
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise DataError(
            f"{bin_path(corpus.prefix)} holds token id {bad}, outside the model's vocabulary "
            f"[0, {vocab_size}) (model.vocab_size)"
        )


def check_eod(corpus: IndexedCorpus, eod_id: int, needed_by: str) -> None:
    """DataError if no probed document ends in the EOD id (a corpus written without
    --append-eod, or the wrong data.megatron.eod_id), when a switch relies on EODs."""
    documents = len(corpus.document_indices) - 1
    probes = np.unique(np.linspace(0, documents - 1, min(documents, EOD_PROBES)).astype(np.int64))
    last_sequences = corpus.document_indices[probes + 1] - 1
    ends = [corpus.sequence(int(s)) for s in last_sequences]
    if not any(len(e) and int(e[-1]) == eod_id for e in ends):
        raise DataError(
            f"{bin_path(corpus.prefix)}: none of {len(probes)} documents checked ends in the "
            f"end-of-document id {eod_id} (data.megatron.eod_id), which data.megatron."
            f"{needed_by} relies on; was it written with --append-eod, and is the id right?"
        )
