"""Megatron's BlendedDataset: which source, and which of its samples, sample i of a mixture is.

With several weighted sources (`--data-path 0.7 A 0.3 B`), megatron-core
(blended_megatron_dataset_builder.py, blended_dataset.py, helpers.cpp) does, per split:

- normalise the weights (float64, divided by their sum);
- ask each source's GPTDataset for ceil(ceil(N * w) * 1.005) samples: the blend's target
  ceil(N * w) plus a 0.5% surplus (`mid_level_dataset_surplus`), which changes how many
  epochs each source is built with and so its shuffle;
- make the blend sum(ceil(N * w)) samples long (which can exceed N), and fill it greedily:
  sample i goes to the source whose share lags furthest behind, argmax_k(w_k * max(i, 1) -
  taken_k), the first one on ties. The BlendedDataset normalises the already normalised
  weights once more, and those are the floats the greedy rule uses.

A single source with no weight (`--data-path A`) is no blend at all: its GPTDataset is asked for
exactly N samples. maxtrain's one-source configs mean that.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass

import numpy as np

from maxtrain.data.megatron.gpt_indices import normalize

SURPLUS = 0.005  # Megatron's default mid_level_dataset_surplus


def target_samples(weights: list[float], num_samples: int) -> list[int]:
    """Samples the blend takes from each source: ceil(N * w) for the normalised weights."""
    return [math.ceil(num_samples * w) for w in normalize(weights)]


def source_samples(weights: list[float], num_samples: int) -> list[int]:
    """Samples each source's GPTDataset is built for: the target plus Megatron's surplus."""
    return [math.ceil(t * (1 + SURPLUS)) for t in target_samples(weights, num_samples)]


@dataclass(frozen=True)
class BlendIndices:
    dataset_index: np.ndarray  # [size] int16: the source of sample i
    dataset_sample_index: np.ndarray  # [size] int64: the sample of that source

    def __len__(self) -> int:
        return len(self.dataset_index)


def build(weights: list[float], num_samples: int) -> BlendIndices:
    """The blend of the sources for a split of num_samples samples (Megatron's greedy fill).

    The greedy choice depends on every earlier one, so it runs as a loop, in plain Python
    floats, which compute w * i - taken exactly as the C++ helper's doubles do (1-2 us per
    sample on the 2-core dev CPU; the caller caches the result on disk).
    """
    size = sum(target_samples(weights, num_samples))
    w = normalize(normalize(weights))
    taken = [0] * len(w)
    picks = array.array("h", bytes(2 * size))
    for i in range(size):
        scale = float(max(i, 1))
        best, best_error = 0, w[0] * scale - taken[0]
        for k in range(1, len(w)):
            error = w[k] * scale - taken[k]
            if error > best_error:
                best, best_error = k, error
        picks[i] = best
        taken[best] += 1
    dataset_index = np.frombuffer(picks, np.int16).copy()
    dataset_sample_index = np.empty(size, np.int64)
    for k in range(len(w)):  # the j-th pick of source k takes its sample j
        chosen = dataset_index == k
        dataset_sample_index[chosen] = np.arange(np.count_nonzero(chosen))
    return BlendIndices(dataset_index, dataset_sample_index)
