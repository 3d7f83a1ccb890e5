"""Synthetic packed text with learnable structure, for runs that need no corpus.

Each token has `branching` possible successors (a fixed random table drawn from the seed), so a
model can learn the text down to a loss of log(branching), well below log(vocab). Documents
of random length are packed into rows with segment ids and per-document positions, exactly
the layout real packed data has. Every row is a pure function of (seed, stream, step, row):
the same on any host count, any run.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class SyntheticText:
    def __init__(self, vocab_size: int, seq_len: int, branching: int, seed: int, stream: int):
        table_rng = np.random.default_rng([seed, 0xB16A4])
        self.successors = table_rng.integers(0, vocab_size, size=(vocab_size, branching))
        self.vocab_size, self.seq_len, self.branching = vocab_size, seq_len, branching
        self.seed, self.stream = seed, stream

    def row(self, step: int, row: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.stream, step, row])
        T = self.seq_len + 1  # one extra token: targets are inputs shifted by one
        choices = rng.integers(0, self.branching, size=T)
        tokens = np.empty(T, np.int32)
        segment_ids = np.empty(T, np.int32)
        positions = np.empty(T, np.int32)
        doc, pos = 1, 0
        doc_len = int(rng.integers(self.seq_len // 4, 2 * self.seq_len))
        for t in range(T):
            if pos == doc_len:  # start the next document
                doc, pos = doc + 1, 0
                doc_len = int(rng.integers(self.seq_len // 4, 2 * self.seq_len))
            if pos == 0:
                tokens[t] = rng.integers(0, self.vocab_size)
            else:
                tokens[t] = self.successors[tokens[t - 1], choices[t]]
            segment_ids[t], positions[t] = doc, pos
            pos += 1
        same_doc = segment_ids[1:] == segment_ids[:-1]  # never predict across a document edge
        return {
            "inputs": tokens[:-1],
            "targets": tokens[1:],
            "loss_mask": same_doc.astype(np.int32),
            "segment_ids": segment_ids[:-1],
            "positions": positions[:-1],
        }

    def batch(self, step: int, rows: range) -> dict[str, np.ndarray]:
        per_row = [self.row(step, r) for r in rows]
        return {k: np.stack([r[k] for r in per_row]) for k in per_row[0]}

    def batches(self, rows: range, start_step: int = 0) -> SyntheticBatches:
        return SyntheticBatches(self, rows, start_step)


class SyntheticBatches(Iterator[dict[str, np.ndarray]]):
    """This host's batches from a step on; its state (the next step) makes resume exact."""

    def __init__(self, text: SyntheticText, rows: range, start_step: int):
        self.text, self.rows, self.step = text, rows, start_step

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.text.batch(self.step, self.rows)
        self.step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
