"""Held-out loss: the mean next-token loss of each held-out stream, and their weighted mean."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from maxtrain.data import to_global
from maxtrain.data.grain_pipeline import EvalStream


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
    eval_fn: (params, batch) -> {nll_sum, tokens, and any further sums, each reported per
    token (or per item the objective counts)} (train_step.eval_step, jitted).
    """
    weighted, total_weight, per_stream = {}, 0.0, {}
    for stream in streams:
        batches = stream.batches()
        outs = [eval_fn(params, to_global(next(batches), sharding)) for _ in range(steps)]
        sums = {k: float(sum(v)) for k, v in jax.device_get(_by_key(outs)).items()}  # one fetch
        count = max(sums.pop("tokens"), 1.0)
        # The loss, and an objective's further sums (DPO: accuracy, reward margin), per item.
        means = {"loss": sums.pop("nll_sum") / count, **{k: v / count for k, v in sums.items()}}
        if stream.name:
            per_stream[f"{stream.name}/loss"] = means["loss"]
        for k, v in means.items():
            weighted[k] = weighted.get(k, 0.0) + stream.weight * v
        total_weight += stream.weight
    means = {k: v / total_weight for k, v in weighted.items()}
    return {**means, "perplexity": float(np.exp(min(means["loss"], 50.0))), **per_stream}


def _by_key(outs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {k: [out[k] for out in outs] for k in outs[0]}
