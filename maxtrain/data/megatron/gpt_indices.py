"""Megatron's GPTDataset indices, rebuilt bit for bit: which tokens sample i of a split holds.

megatron-core (megatron/core/datasets/gpt_dataset.py, blended_megatron_dataset_builder.py,
helpers.cpp) turns a corpus into samples in four steps, each reproduced here with the same
arithmetic and the same random draws, so the same seed gives the same samples:

1. Split: the split string ("969,30,1") is normalised to fractions; split s holds the
   sequences [round(lo * n), round(hi * n)) of the corpus (Python's round: half to even).
2. Document index: the split's sequence ids repeated for as many epochs as the requested
   number of samples needs, shuffled by numpy.random.RandomState(seed). When the final epoch
   would supply fewer than 80% of an epoch's samples it is shuffled separately, after the
   others, so a short extra epoch does not mix its documents into the earlier ones.
3. Sample index: the shuffled documents are laid end to end; sample i is the seq_len + 1 tokens
   from position i * seq_len, so consecutive samples share one token (the last target of one
   is the first input of the next). Entry i is (position in the document index, offset in that
   document) of position i * seq_len. Megatron computes it in C++ by walking the documents; a
   search over the cumulative lengths gives the same pairs.
4. Shuffle index: a permutation of the samples by the same RandomState, continuing after the
   document shuffle; the separate final epoch's samples are permuted among themselves.

Sample i of the dataset is then sample shuffle_index[i] of the sample index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SPLITS = ("train", "valid", "test")
ADD_EXTRA_TOKEN = 1  # samples hold seq_len + 1 tokens (Megatron's add_extra_token_to_sequence)
SEPARATE_FINAL_EPOCH_BELOW = 0.80  # of an epoch's samples


def split_fractions(split: str) -> list[float]:
    """ "969,30,1" -> [0.969, 0.03, 0.001]: Megatron's parse_and_normalize_split."""
    weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    weights += [0.0] * (len(SPLITS) - len(weights))
    return normalize(weights)


def normalize(weights: list[float]) -> list[float]:
    """Megatron's `normalize`: divide by the sum in float64 (the exact float results matter)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_ranges(split: str, num_sequences: int) -> dict[str, range | None]:
    """{split name: its range of sequence ids, or None when its fraction is 0}."""
    bounds = [0.0]
    for fraction in split_fractions(split):
        bounds.append(bounds[-1] + fraction)  # Megatron's running sum, in the same order
    ranges: dict[str, range | None] = {}
    for name, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:], strict=True):
        if hi <= lo:
            ranges[name] = None
        else:
            ranges[name] = range(int(round(lo * num_sequences)), int(round(hi * num_sequences)))
    return ranges


def num_epochs(tokens_per_epoch: int, num_samples: int, seq_len: int) -> int:
    """Epochs over the split needed for num_samples samples of seq_len + 1 tokens (at least 1)."""
    needed = num_samples * seq_len + ADD_EXTRA_TOKEN
    return max(1, -(-needed // tokens_per_epoch))


def samples_in(tokens: int, seq_len: int) -> int:
    """Whole samples in a stream of this many tokens (the last sample's extra token included)."""
    return (tokens - ADD_EXTRA_TOKEN) // seq_len


def separate_final_epoch(tokens_per_epoch: int, epochs: int, num_samples: int, seq_len: int):
    """Whether the last epoch is shuffled on its own: it supplies < 80% of an epoch's samples."""
    if epochs == 1:
        return False
    from_final_epoch = num_samples - samples_in((epochs - 1) * tokens_per_epoch, seq_len)
    per_epoch = samples_in(tokens_per_epoch, seq_len)
    return from_final_epoch < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch)


def document_index(
    documents: range, epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """[epochs * len(documents)] int32 sequence ids, shuffled (Megatron's _build_document_index)."""
    if separate_final and epochs > 1:
        first = document_index(documents, epochs - 1, rng, False)
        return np.concatenate([first, document_index(documents, 1, rng, False)])
    index = np.tile(np.arange(documents.start, documents.stop, dtype=np.int32), epochs)
    rng.shuffle(index)
    return index


def sample_index(sequence_lengths: np.ndarray, doc_index: np.ndarray, seq_len: int) -> np.ndarray:
    """[samples + 1, 2]: (position in doc_index, offset) where each sample starts.

    Megatron's build_sample_idx walks the documents in C++; the sample boundary i * seq_len
    lies in the document whose cumulative end first exceeds it, which a binary search finds.
    Its dtype follows Megatron's too: int32 unless the index or a length needs int64.
    """
    lengths = sequence_lengths[doc_index].astype(np.int64)  # [epochs * docs]
    ends = np.cumsum(lengths)
    num_samples = samples_in(int(ends[-1]), seq_len)
    boundaries = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    doc = np.searchsorted(ends, boundaries, side="right")
    offset = boundaries - (ends[doc] - lengths[doc])
    fits_int32 = max(len(doc_index), int(sequence_lengths.max())) <= np.iinfo(np.int32).max
    return np.stack([doc, offset], axis=1).astype(np.int32 if fits_int32 else np.int64)


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """[total] a permutation of the samples: [0, num_samples) shuffled, then the rest (the
    separate final epoch) shuffled among themselves (Megatron's _build_shuffle_index)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


@dataclass(frozen=True)
class GptIndices:
    """The three arrays of one GPTDataset (one source, one split)."""

    document_index: np.ndarray  # [epochs * documents] int32 sequence ids
    sample_index: np.ndarray  # [samples + 1, 2] (position in document_index, offset)
    shuffle_index: np.ndarray  # [samples] which sample of the sample index is sample i

    def __len__(self) -> int:
        return len(self.shuffle_index)


def build(
    sequence_lengths: np.ndarray, documents: range, num_samples: int, seq_len: int, seed: int
) -> GptIndices:
    """Megatron's GPTDataset indices for `num_samples` samples of the sequences `documents`.

    The dataset may hold more samples than asked (whole epochs); Megatron keeps them all, and
    the shuffle spans them, so they are kept here too. The caller checks that the split holds
    tokens: Megatron loops forever on an empty one.
    """
    tokens_per_epoch = int(sequence_lengths[documents.start : documents.stop].sum(dtype=np.int64))
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_len)
    separate = separate_final_epoch(tokens_per_epoch, epochs, num_samples, seq_len)
    rng = np.random.RandomState(seed)
    doc_index = document_index(documents, epochs, rng, separate)
    samples = sample_index(sequence_lengths, doc_index, seq_len)
    total = len(samples) - 1
    before_final = samples_in((epochs - 1) * tokens_per_epoch, seq_len) if separate else total
    return GptIndices(doc_index, samples, shuffle_index(before_final, total, rng))
