"""Group Relative Policy Optimisation (Shao et al., 2024): the objective, with the variants of
Dr.GRPO (Liu et al., 2025) and DAPO (Yu et al., 2025).

Each batch row holds one sampled completion after its prompt (maxtrain/posttrain/rollout.py
builds the rows): `loss_mask` is 1 on the completion's targets, `old_logp` holds the
log-probability each target had under the policy that sampled it, and `advantages` the
completion's group-relative advantage on each of its tokens. With ratio = exp(logp - old_logp)
per completion token,

    token loss = -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) + kl_beta k3,
    k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's unbiased, positive KL estimator),

ref the frozen start checkpoint's log-probability (train.grpo.kl k3; with LoRA the base under
zero adapters, else a frozen copy: training/split.py). The token losses are weighted so that
the step's one division (LossSums: sums and a count that add up over micro-batches and
devices) gives each paper's normalisation:

    grpo     1 / (the completion's tokens), count: completions  (mean of per-completion means)
    dr_grpo  1, count: completions x max_new_tokens            (a constant normaliser)
    dapo     1, count: completion tokens                       (every token weighs the same)

Log-probabilities are of the logits divided by the sampling temperature: the distribution the
sampler drew from (top-p's truncation aside, as in the papers' implementations).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config.run import GRPOConfig
from maxtrain.kernels.cross_entropy import cross_entropy
from maxtrain.models import ModelDef
from maxtrain.training.objectives import LossSums

ADVANTAGE_EPS = 1e-6  # added to the group's std before dividing (a group of equal rewards: A = 0)


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool) -> np.ndarray:
    """[P * G] rewards, each prompt's G completions adjacent -> [P * G] advantages:
    r - mean of its group, divided by (the group's std + ADVANTAGE_EPS) when `scale`
    (GRPO, DAPO; Dr.GRPO leaves it out: it weighs easy and hard prompts unequally)."""
    groups = rewards.reshape(-1, group_size).astype(np.float64)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, keepdims=True) + ADVANTAGE_EPS)
    return centred.reshape(-1).astype(np.float32)


def policy_logps(
    mdef: ModelDef, params: Any, batch: dict[str, jax.Array], temperature: float
) -> tuple[jax.Array, jax.Array, Any]:
    """([B, T] float32 log-probability of each target at the temperature, 0 where loss_mask is
    0; the model's auxiliary loss; its statistics). The rollout's old log-probabilities come
    from this same function on the same parameters (posttrain/rollout.py)."""
    logits, aux_loss, stats = mdef.apply(
        params, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    if temperature != 1.0:
        logits = logits.astype(jnp.float32) / temperature
    nll, _ = cross_entropy(logits, batch["targets"])
    return -nll * batch["loss_mask"].astype(jnp.float32), aux_loss, stats


def token_weights(mask: jax.Array, loss: str, max_new_tokens: int) -> tuple[jax.Array, jax.Array]:
    """([B, T] weight of each token's loss, the count the weighted sum is divided by) for the
    normalisation `loss` (module docstring)."""
    tokens = mask.sum(-1)  # [B]
    rows = (tokens > 0).astype(jnp.float32)
    if loss == "grpo":
        return mask / jnp.maximum(tokens, 1.0)[:, None], rows.sum()
    if loss == "dr_grpo":
        return mask, rows.sum() * max_new_tokens
    return mask, tokens.sum()


def token_losses(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    ref_logp: jax.Array | None,
    clip_low: float,
    clip_high: float,
    kl_beta: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """([B, T] token loss, [B, T] k3 KL (0 without a reference), [B, T] 1 where the clip
    holds the ratio: the gradient of that token's policy term is 0)."""
    ratio = jnp.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -jnp.minimum(unclipped, clipped)
    held = (clipped < unclipped).astype(jnp.float32)
    if ref_logp is None:
        return loss, jnp.zeros_like(loss), held
    delta = ref_logp - logp
    kl = jnp.exp(delta) - delta - 1.0
    return loss + kl_beta * kl, kl, held


class GRPO:
    """The clipped policy-gradient objective (training/objectives.py's contract)."""

    def __init__(self, grpo: GRPOConfig):
        self.cfg = grpo
        self.uses_reference = grpo.kl != "none"

    def __call__(
        self,
        mdef: ModelDef,
        params: Any,
        batch: dict[str, jax.Array],
        z_loss: float,
        reference: Any = None,
    ) -> LossSums:
        del z_loss  # a pre-training regulariser; the policy's loss is its own
        cfg = self.cfg
        logp, aux_loss, stats = policy_logps(mdef, params, batch, cfg.temperature)
        ref = None
        if self.uses_reference:
            ref = jax.lax.stop_gradient(policy_logps(mdef, reference, batch, cfg.temperature)[0])
        mask = batch["loss_mask"].astype(jnp.float32)
        losses, kl, held = token_losses(
            logp,
            batch["old_logp"],
            batch["advantages"],
            ref,
            cfg.clip_low,
            cfg.clip_high,
            cfg.kl_beta,
        )
        weights, count = token_weights(mask, cfg.loss, cfg.max_new_tokens)
        sums = {
            # weighted as the loss weighs tokens: per-completion means under grpo
            "grpo/kl": (weights * kl).sum(),
            "grpo/clipped": (weights * held).sum(),
            # exp(logp - old) - 1 summed: 0 at a rollout's first update when the trainer's
            # forward reproduces the old log-probabilities exactly
            "grpo/ratio_dev": (weights * jnp.abs(jnp.exp(logp - batch["old_logp"]) - 1)).sum(),
        }
        return LossSums((weights * losses).sum(), count, jnp.zeros(()), aux_loss, stats, sums)
