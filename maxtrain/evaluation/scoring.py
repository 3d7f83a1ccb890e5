"""Log-likelihood of continuations: the one model computation every task needs.

A request is (context ids, continuation ids). Its tokens are laid out like a training row
(inputs, next-token targets, a mask on the continuation's targets) in batches of the run's
micro-batch shape, so the train loop's model, pipeline stages and sharding take them as they
are; a context longer than the row is cut from the left, as the model would only have seen
its end anyway. For each request the jitted function returns the continuation's summed log
probability and whether every continuation token is the model's argmax (greedy decoding would
have produced it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from maxtrain.common.errors import UserError
from maxtrain.data import batch_sharding
from maxtrain.models import ModelDef
from maxtrain.parallel.mesh import sharding_rules

type Request = tuple[Sequence[int], Sequence[int]]


def continuation_scores(params: Any, batch: dict[str, jax.Array], *, mdef: ModelDef) -> dict:
    """Per row: the masked targets' summed log probability, and whether all are the argmax."""
    logits = mdef.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"]).logits
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    targets, mask = batch["targets"], batch["loss_mask"].astype(jnp.float32)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = (jnp.argmax(logp, axis=-1) == targets) | (mask == 0)
    return {"logprob": jnp.sum(target_logp * mask, axis=-1), "greedy": jnp.all(greedy, axis=-1)}


class Scorer:
    """Scores requests in batches of [rows, length] tokens on a mesh."""

    def __init__(self, mdef: ModelDef, mesh: Mesh, rules: dict, rows: int, length: int):
        self.rows, self.length = rows, length
        self.sharding = batch_sharding(mesh, rules)

        def traced(params, batch):
            with sharding_rules(mesh, rules):
                return continuation_scores(params, batch, mdef=mdef)

        self.fn = jax.jit(traced)

    def __call__(
        self, params: Any, requests: Sequence[Request], progress: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(log probabilities [n] float64, greedy [n] bool) of the requests, in order.
        progress: a label for a progress bar on stderr (shown on a terminal only)."""
        logprob, greedy = [], []
        starts = range(0, len(requests), self.rows)
        off = True if progress is None else None  # None: tqdm shows it on a terminal only
        for start in tqdm(starts, desc=progress, unit=" batch", file=sys.stderr, disable=off):
            chunk = requests[start : start + self.rows]
            batch = self._batch(chunk)
            out = jax.device_get(self.fn(params, jax.device_put(batch, self.sharding)))
            logprob.append(out["logprob"][: len(chunk)].astype(np.float64))
            greedy.append(out["greedy"][: len(chunk)])
        return np.concatenate(logprob), np.concatenate(greedy)

    def _batch(self, chunk: Sequence[Request]) -> dict[str, np.ndarray]:
        shape = (self.rows, self.length)
        batch = {
            "inputs": np.zeros(shape, np.int32),
            "targets": np.zeros(shape, np.int32),
            "loss_mask": np.zeros(shape, np.int32),
            "segment_ids": np.ones(shape, np.int32),
            "positions": np.broadcast_to(np.arange(self.length, dtype=np.int32), shape).copy(),
        }
        for row, (context, continuation) in enumerate(chunk):
            if len(continuation) > self.length or not context:
                raise UserError(
                    f"a continuation of {len(continuation)} tokens does not fit rows of "
                    f"{self.length} after its context"
                )
            tokens = [*context, *continuation][-(self.length + 1) :]
            n = len(tokens) - 1
            batch["inputs"][row, :n] = tokens[:-1]
            batch["targets"][row, :n] = tokens[1:]
            batch["loss_mask"][row, n - len(continuation) : n] = 1
        return batch
