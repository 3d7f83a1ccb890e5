"""Direct Preference Optimisation (Rafailov et al., 2023): the objective, and the frozen
reference it compares the policy with.

Each batch row holds one pair: segment 1 the prompt and chosen answer, segment 2 the prompt
and rejected one, loss_mask on the answers (maxtrain/data/chat.py PreferenceRows). With
log-probabilities summed over each answer, policy pi and the frozen reference ref,

    h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    sigmoid: -log sigmoid(beta * h);  ipo (Azar et al., 2023): (h - 1 / (2 beta))^2.

The reference is the model the run started from (checkpoint.load_parameters_path). Its
log-probabilities are computed inside the step, on the same mesh, from the parameter split's
`start` (training/split.py): with LoRA the frozen base under zero adapters, with nothing to
store; else a frozen copy of the start, held by `ReferenceCopy`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxtrain.config import Config
from maxtrain.config.run import DPOConfig
from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.models import ModelDef
from maxtrain.training.objectives import LossSums
from maxtrain.training.split import WholeModel

CHOSEN, REJECTED = 1, 2  # the segment ids of a preference row's answers (data/chat.py)


def target_logps(mdef: ModelDef, params: Any, batch: dict[str, jax.Array]):
    """([B, T] float32 log-probability of each target, 0 where loss_mask is 0; the model's
    auxiliary loss; its statistics)."""
    logits, aux_loss, stats = mdef.apply(
        params, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    nll, _ = cross_entropy(logits, batch["targets"])
    return -nll * batch["loss_mask"].astype(jnp.float32), aux_loss, stats


def answer_logps(logps: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T] per-token log-probabilities -> ([B] chosen, [B] rejected) answer totals."""
    chosen = jnp.where(segment_ids == CHOSEN, logps, 0.0).sum(-1)
    rejected = jnp.where(segment_ids == REJECTED, logps, 0.0).sum(-1)
    return chosen, rejected


def preference_losses(
    policy: jax.Array, reference: jax.Array, segment_ids: jax.Array, beta: float, kind: str
) -> tuple[jax.Array, jax.Array]:
    """([B] loss per pair, [B] log-ratio difference h) from [B, T] token log-probabilities."""
    pi_chosen, pi_rejected = answer_logps(policy, segment_ids)
    ref_chosen, ref_rejected = answer_logps(reference, segment_ids)
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if kind == "sigmoid":
        return -jax.nn.log_sigmoid(beta * h), h
    return jnp.square(h - 1.0 / (2.0 * beta)), h


class DPO:
    """The DPO objective (training/objectives.py's contract), summed over the batch's pairs."""

    uses_reference = True

    def __init__(self, dpo: DPOConfig):
        self.beta, self.kind = dpo.beta, dpo.loss

    def __call__(
        self,
        mdef: ModelDef,
        params: Any,
        batch: dict[str, jax.Array],
        z_loss: float,
        reference: Any = None,
    ) -> LossSums:
        del z_loss  # a token-level regulariser; DPO's loss is per pair
        policy, aux_loss, stats = target_logps(mdef, params, batch)
        ref = jax.lax.stop_gradient(target_logps(mdef, reference, batch)[0])
        segments = batch["segment_ids"]
        losses, h = preference_losses(policy, ref, segments, self.beta, self.kind)
        pairs = jnp.any(segments == CHOSEN, axis=-1).astype(jnp.float32)  # not padding
        sums = {
            "dpo/reward_margin": (self.beta * h * pairs).sum(),  # the implicit reward's margin
            # The share of pairs the policy ranks right, relative to the reference; a tie
            # (h = 0, as at the start) counts half, so that the start reads as chance, 0.5.
            "dpo/accuracy": ((jnp.sign(h) + 1) / 2 * pairs).sum(),
        }
        return LossSums((losses * pairs).sum(), pairs.sum(), jnp.zeros(()), aux_loss, stats, sums)


class ReferenceCopy(WholeModel):
    """DPO (and GRPO's KL penalty) without adapters: the whole model trains, and a frozen copy
    of the parameters it started from is the reference (a second copy on the devices)."""

    has_frozen = True

    def split(self, params: dict) -> tuple[dict, Any]:
        return params, params

    def start(self, trained: Any, frozen: Any) -> Any:
        del trained
        return frozen

    def describe(self, cfg: Config) -> str:
        return f"a frozen copy of {cfg.checkpoint.load_parameters_path} as the reference, "
