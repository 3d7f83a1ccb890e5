"""Megatron's samples in the train step's layout, with Megatron's token-handling switches.

A sample is seq_len + 1 tokens; inputs are the first seq_len, targets the last seq_len (Megatron's
`tokens` and `labels`). What Megatron's `_get_ltor_masks_and_position_ids` does with end-of-
document (EOD) tokens, in maxtrain's terms:

- default: one segment per row (attention crosses documents), positions 0..seq_len-1, every
  target trained. This is Megatron's default and needs no EOD id.
- reset_attention_mask: a token after an EOD cannot see anything up to and including it, that
  is, a new segment starts after every EOD (the EOD belongs to the document it ends).
- reset_position_ids: positions restart at 0 after every EOD.
- eod_mask_loss: no loss where the INPUT is an EOD (the prediction of the next document's first
  token from the previous one's end), Megatron's choice, not where the target is.

`segment_ids`, `positions` and `loss_mask` carry these into maxtrain's attention, RoPE and loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenHandling:
    eod_id: int | None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def switches_on(self) -> list[str]:
        """The names of the switches that are on: each one relies on EOD tokens."""
        names = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
        return [name for name in names if getattr(self, name)]


def to_batch(windows: np.ndarray, handling: TokenHandling) -> dict[str, np.ndarray]:
    """[R, seq_len + 1] token windows -> the BATCH_KEYS arrays, each [R, seq_len] int32."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    rows, seq_len = inputs.shape
    t = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
    ones = np.ones((rows, seq_len), np.int32)
    if not handling.switches_on:
        return _batch(inputs, targets, ones, ones, t)
    is_eod = inputs == handling.eod_id
    after_eod = np.zeros_like(is_eod)
    after_eod[:, 1:] = is_eod[:, :-1]  # the first token of a new document
    segment_ids = 1 + np.cumsum(after_eod, axis=1, dtype=np.int32)
    document_start = np.maximum.accumulate(np.where(after_eod, t, 0), axis=1)
    return _batch(
        inputs,
        targets,
        (~is_eod).astype(np.int32) if handling.eod_mask_loss else ones,
        segment_ids if handling.reset_attention_mask else ones,
        t - document_start if handling.reset_position_ids else t,
    )


def _batch(inputs, targets, loss_mask, segment_ids, positions) -> dict[str, np.ndarray]:
    arrays = {
        "inputs": inputs,
        "targets": targets,
        "loss_mask": loss_mask,
        "segment_ids": segment_ids,
        "positions": positions,
    }
    return {k: np.ascontiguousarray(v, np.int32) for k, v in arrays.items()}
