"""Packing documents into fixed-length rows, and rows into the train step's batch layout.

A packed row holds `seq_len + 1` tokens so that inputs (the first seq_len) and targets (the last
seq_len) come from one row. grain's packers mark each row with `*_segment_ids` (1, 2, ... per
document within the row, 0 = padding) and `*_positions` (restarting at 0 per segment), which is
what attention masking and RoPE need.

Neither packer drops tokens:
- concat_then_split concatenates the stream and cuts rows of exactly seq_len + 1 tokens (no
  padding). A document cut at a row edge continues at the start of the next row as a new
  segment whose positions restart at 0; the one transition across the cut is not trained.
- first_fit places whole pieces into the first row with room (padding the rest), and grain
  requires each piece to fit a row, so longer documents are first split into chunks of at most
  seq_len + 1 tokens. Consecutive chunks overlap by one token, so every next-token transition of
  the document is trained exactly once; each chunk is its own segment with positions restarting
  at 0 (the model sees the middle of a long document at small positions, as with the cut above).
"""

from __future__ import annotations

from collections.abc import Callable

import grain
import numpy as np

FEATURE = "tokens"  # the packed feature; grain adds tokens_segment_ids and tokens_positions
# Fine-tuning data adds a second feature, packed alongside: 1 where predicting the token counts
# (maxtrain/data/chat.py); pre-training documents in such a mixture carry it as all ones.
LOSS = "loss"


class SplitLongDocuments(grain.experimental.FlatMapTransform):
    """Cuts a document into chunks of at most `row_len` tokens, overlapping by one token.

    A top-level class so the pipeline stays picklable for grain worker processes.
    """

    max_fan_out = 2**31  # a bound grain checks only in its MapDataset variant; we use the Iter one

    def __init__(self, row_len: int):
        if row_len < 2:
            raise ValueError(f"row_len must be at least 2 to hold a transition, got {row_len}")
        self.row_len = row_len

    def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        length = len(element[FEATURE])
        if length <= self.row_len:
            return [element]
        stride = self.row_len - 1  # chunk k+1 starts at the last token of chunk k
        starts = range(0, length - 1, stride)
        return [{k: v[s : s + self.row_len] for k, v in element.items()} for s in starts]


class _JsonSafeConcatThenSplit(grain.IterDataset):
    """ConcatThenSplitIterDataset whose state survives a JSON round trip.

    grain 0.2.18 marks "no remainder" as the tuple (-1, -1) and compares with `!=`, so after
    JSON (which is how grain.checkpoint stores iterator state) the list [-1, -1] reads as a
    remainder and the restored stream differs. set_state turns the slices back into tuples.
    """

    def __init__(self, parent: grain.IterDataset, lengths: dict[str, int]):
        super().__init__(
            grain.experimental.ConcatThenSplitIterDataset(parent, length_struct=lengths)
        )

    def __iter__(self) -> grain.DatasetIterator:
        return _TupleSlicesIterator(self._parent.__iter__())


class _TupleSlicesIterator(grain.DatasetIterator):
    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._parent)

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        slices = {k: tuple(v) for k, v in state["remainder_slices"].items()}
        self._parent.set_state({**state, "remainder_slices": slices})


def _concat_then_split(
    ds: grain.IterDataset, lengths: dict[str, int], bins: int, seed: int
) -> grain.IterDataset:
    del bins, seed  # rows are cut from one running stream: nothing to bin or shuffle
    return _JsonSafeConcatThenSplit(ds, lengths)


def _first_fit(
    ds: grain.IterDataset, lengths: dict[str, int], bins: int, seed: int
) -> grain.IterDataset:
    chunks = grain.experimental.FlatMapIterDataset(ds, SplitLongDocuments(lengths[FEATURE]))
    return grain.experimental.FirstFitPackIterDataset(
        chunks, length_struct=lengths, num_packing_bins=bins, seed=seed
    )


PACKERS: dict[str, Callable[[grain.IterDataset, dict[str, int], int, int], grain.IterDataset]] = {
    "concat_then_split": _concat_then_split,
    "first_fit": _first_fit,
}


def pack(
    ds: grain.IterDataset, packing: str, row_len: int, bins: int, seed: int, loss: bool = False
):
    """Documents {"tokens": [n]} -> rows {"tokens", "tokens_segment_ids", "tokens_positions"};
    with loss, documents and rows also hold the "loss" feature."""
    lengths = {FEATURE: row_len, **({LOSS: row_len} if loss else {})}
    return PACKERS[packing](ds, lengths, bins, seed)


def rows_to_batch(rows: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    """Packed rows of seq_len + 1 -> the [R, seq_len] int32 batch of maxtrain/training/step.py.

    loss_mask is 1 only where the target is a real token of the same segment as its input, so a
    row never asks the model to predict across a document (or chunk) edge or into padding; with
    the "loss" feature, also only where the target's flag is 1 (fine-tuning: assistant tokens).
    """
    tokens = np.stack([r[FEATURE] for r in rows]).astype(np.int32)  # [R, T+1]
    segments = np.stack([r[f"{FEATURE}_segment_ids"] for r in rows]).astype(np.int32)
    positions = np.stack([r[f"{FEATURE}_positions"] for r in rows]).astype(np.int32)
    counted = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    if LOSS in rows[0]:
        counted &= np.stack([r[LOSS] for r in rows])[:, 1:] != 0
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": counted.astype(np.int32),
        "segment_ids": segments[:, :-1],
        "positions": positions[:, :-1],
    }
