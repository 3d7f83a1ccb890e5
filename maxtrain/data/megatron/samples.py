"""Random access to Megatron's samples: sample i of a source's split, or of a blend, as tokens.

`GptSamples` is one source's GPTDataset (gpt_indices.py) over its memory-mapped corpus;
`BlendedSamples` is the BlendedDataset (blend.py) over several of them. Both answer
`windows(ids)`: the seq_len + 1 token ids of each requested sample, [len(ids), seq_len + 1]
int32, gathered with one fancy index into the corpus per source, so reading a batch costs the
same whether its samples span one document or many. Samples are addressed by index alone, so
any host can read any rows of any step without reading what comes before.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from maxtrain.data.megatron.indexed import IndexedCorpus


class GptSamples:
    """A GPTDataset: `arrays` holds its document_index, sample_index and shuffle_index."""

    def __init__(self, corpus: IndexedCorpus, arrays: Mapping[str, np.ndarray], seq_len: int):
        self.corpus, self.arrays, self.seq_len = corpus, arrays, seq_len

    def __len__(self) -> int:
        return len(self.arrays["shuffle_index"])

    def windows(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), seq_len + 1] int32: the tokens of samples `ids` (shuffled order)."""
        samples = np.asarray(self.arrays["shuffle_index"][ids], np.int64)
        bounds = self.arrays["sample_index"]
        first_doc, first_offset = (bounds[samples, k].astype(np.int64) for k in (0, 1))
        last_doc, last_offset = (bounds[samples + 1, k].astype(np.int64) for k in (0, 1))
        # One part per (sample, document it touches): parts of sample r are documents
        # first_doc[r] .. last_doc[r] of the document index, in order.
        parts = last_doc - first_doc + 1
        row = np.repeat(np.arange(len(ids)), parts)
        position = np.arange(len(row)) - np.repeat(np.cumsum(parts) - parts, parts)
        doc = first_doc[row] + position
        sequence = np.asarray(self.arrays["document_index"][doc], np.int64)
        begin = np.where(position == 0, first_offset[row], 0)
        is_last = doc == last_doc[row]
        end = np.where(is_last, last_offset[row] + 1, self.corpus.sequence_lengths[sequence])
        lengths = end - begin
        start = self.corpus.token_offsets(sequence) + begin  # in corpus.tokens
        offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens = self.corpus.tokens[np.repeat(start, lengths) + offsets]
        return tokens.reshape(len(ids), self.seq_len + 1).astype(np.int32)


class BlendedSamples:
    """A BlendedDataset: sample i is sample dataset_sample_index[i] of source dataset_index[i]."""

    def __init__(self, sources: list[GptSamples], arrays: Mapping[str, np.ndarray]):
        self.sources, self.arrays = sources, arrays

    def __len__(self) -> int:
        return len(self.arrays["dataset_index"])

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.arrays["dataset_index"][ids])

    def windows(self, ids: np.ndarray) -> np.ndarray:
        source = self.source_of(ids)
        inner = np.asarray(self.arrays["dataset_sample_index"][ids])
        out = np.empty((len(ids), self.sources[0].seq_len + 1), np.int32)
        for k in np.unique(source):
            chosen = source == k
            out[chosen] = self.sources[k].windows(inner[chosen])
        return out
