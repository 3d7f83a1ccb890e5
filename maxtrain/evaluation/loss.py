"""Held-out loss: the mean next-token loss of each held-out stream, and their weighted mean."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from maxtrain.data import to_global
from maxtrain.data.pipeline import EvalStream


def held_out_loss(
    eval_fn: Callable,
    params: Any,
    sharding: NamedSharding,
    streams: Sequence[EvalStream],
    steps: int,
) -> dict[str, float]:
    """Loss per held-out stream over `steps` batches, and overall.

    Each stream restarts from its beginning, so evals at different steps score the same tokens
    and are comparable. The overall loss weights each stream's loss by its source weight: the
    expected loss per token of the training mixture, whatever the sources' eval sizes.
    eval_fn: (params, batch) -> {nll_sum, tokens} (train_step.eval_step, jitted).
    """
    weighted, total_weight, per_stream = 0.0, 0.0, {}
    for stream in streams:
        batches = stream.batches()
        nll, tokens = [], []
        for _ in range(steps):
            out = eval_fn(params, to_global(next(batches), sharding))
            nll.append(out["nll_sum"])  # device scalars: fetched once per stream, below
            tokens.append(out["tokens"])
        loss = float(sum(jax.device_get(nll))) / max(float(sum(jax.device_get(tokens))), 1.0)
        if stream.name:
            per_stream[f"{stream.name}/loss"] = loss
        weighted, total_weight = weighted + stream.weight * loss, total_weight + stream.weight
    loss = weighted / total_weight
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), **per_stream}
