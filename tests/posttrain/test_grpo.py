"""GRPO's objective against a NumPy statement of the papers' formulas: group advantages, the
clipped ratio, the k3 KL, each loss normalisation, and the gradients through the model."""

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.config.run import GRPOConfig
from maxtrain.posttrain.dpo import ReferenceCopy
from maxtrain.posttrain.grpo import (
    ADVANTAGE_EPS,
    GRPO,
    group_advantages,
    token_losses,
    token_weights,
)
from maxtrain.training.loop import build_trainer
from maxtrain.training.step import summed_grads

CLIP_LOW, CLIP_HIGH, BETA, MAX_NEW = 0.2, 0.28, 0.05, 7


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_are_reward_minus_group_mean_over_std(scale):
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0.5, 0, 0, 0.25], np.float32)
    got = group_advantages(rewards, 4, scale)
    for g in range(3):
        group = [float(r) for r in rewards[4 * g : 4 * g + 4]]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        for i, r in enumerate(group):
            expected = (r - mean) / (std + ADVANTAGE_EPS) if scale else r - mean
            assert math.isclose(got[4 * g + i], expected, rel_tol=1e-6, abs_tol=1e-7)
    assert np.all(got[4:8] == 0)  # a group of equal rewards teaches nothing


def _numpy_loss_and_grad(logp, old, ref, adv, mask, loss, beta):
    """The mean loss and its gradient in logp, token by token (float64)."""
    grad = np.zeros_like(logp, np.float64)
    row_sums, tokens = [], []
    for b in range(logp.shape[0]):
        row, n = 0.0, int(mask[b].sum())
        for t in np.flatnonzero(mask[b]):
            r = math.exp(logp[b, t] - old[b, t])
            a = float(adv[b, t])
            pg = -min(r * a, min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH) * a)
            held = (r > 1 + CLIP_HIGH and a > 0) or (r < 1 - CLIP_LOW and a < 0)
            g = 0.0 if held else -a * r
            if ref is not None:
                d = ref[b, t] - logp[b, t]
                pg += beta * (math.exp(d) - d - 1)
                g += beta * (1 - math.exp(d))
            weight = 1 / n if loss == "grpo" else 1.0
            row += weight * pg
            grad[b, t] = weight * g
        row_sums.append(row)
        tokens.append(n)
    count = {
        "grpo": len(row_sums),
        "dr_grpo": len(row_sums) * MAX_NEW,
        "dapo": sum(tokens),
    }[loss]
    return sum(row_sums) / count, grad / count


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_token_loss_and_gradient_are_the_formula(loss, kl):
    rng = np.random.default_rng(0)
    B, T = 6, 10
    lengths = [1, 3, 7, 4, 7, 2]  # ragged completions after a prompt of 2 tokens
    mask = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        mask[b, 2 : 2 + n] = 1
    old = -rng.uniform(0.1, 3, (B, T)).astype(np.float32)
    # ratios from 0.5 to 1.6: inside the clip and beyond it on both sides
    logp = old + np.log(rng.uniform(0.5, 1.6, (B, T))).astype(np.float32)
    ref = (old - rng.uniform(-0.5, 0.5, (B, T))).astype(np.float32) if kl else None
    adv = np.repeat(rng.normal(size=(B, 1)), T, axis=1).astype(np.float32)

    def mean_loss(lp):
        ref_lp = None if ref is None else jnp.asarray(ref)
        losses, _, _ = token_losses(lp, old, adv, ref_lp, CLIP_LOW, CLIP_HIGH, BETA)
        weights, count = token_weights(jnp.asarray(mask), loss, MAX_NEW)
        return (weights * losses).sum() / count

    value, grad = jax.value_and_grad(mean_loss)(jnp.asarray(logp))
    expected, expected_grad = _numpy_loss_and_grad(logp, old, ref, adv, mask, loss, BETA)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-7)
    ratio = np.exp(logp - old)
    assert (ratio[mask > 0] > 1 + CLIP_HIGH).any() and (ratio[mask > 0] < 1 - CLIP_LOW).any()


def test_clipped_share_counts_the_tokens_the_clip_holds():
    logp = jnp.log(jnp.array([[0.5, 0.9, 1.5, 1.5, 0.5]]))
    adv = jnp.array([[-1.0, -1.0, 1.0, -1.0, 1.0]])
    _, kl, held = token_losses(logp, jnp.zeros_like(logp), adv, None, 0.2, 0.2, 0.0)
    # held below 1 - 0.2 with A < 0, above 1 + 0.2 with A > 0; never on the other sides
    np.testing.assert_array_equal(held, [[1, 0, 1, 0, 0]])
    assert not kl.any()


@pytest.fixture(scope="module")
def policy_case(tmp_path_factory):
    """A tiny model, a batch of sampled-looking rows, old log-probs and a reference off the
    policy."""
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [
            "model_name=tiny", "data.kind=synthetic", "train.global_batch_size=4",
            "train.seq_len=16", f"run.output_dir={tmp_path_factory.mktemp('grpo')}",
        ],
    )  # fmt: skip
    trainer = build_trainer(cfg, jax.devices()[:1])
    params = trainer.state.params
    rng = np.random.default_rng(1)
    B, T = 4, 16
    tokens = rng.integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    mask = np.zeros((B, T), np.int32)
    for b, (start, n) in enumerate([(3, 5), (5, 9), (2, 1), (4, 12)]):
        mask[b, start : start + n] = 1
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": mask,
        "segment_ids": np.ones((B, T), np.int32),
        "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        "old_logp": (-rng.uniform(4, 7, (B, T)) * mask).astype(np.float32),
        "advantages": np.repeat(rng.normal(size=(B, 1)), T, axis=1).astype(np.float32),
    }
    noise = jax.tree.map(lambda x: 0.02 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), params)
    reference = jax.tree.map(jnp.add, params, noise)
    return trainer, jax.tree.map(jnp.asarray, batch), params, reference


@pytest.mark.slow  # builds and steps a trainer
def test_objective_gradients_through_the_model_are_the_formula(policy_case, loss="grpo"):
    """The step's summed gradients over the count equal jax.grad of the mean loss written out
    from the model's logits (log-softmax at the temperature, gather, the token formula). One
    normalisation: the others differ only in token_weights, held to NumPy above."""
    trainer, batch, params, reference = policy_case
    cfg = GRPOConfig(
        temperature=0.7, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl="k3", kl_beta=BETA,
        loss=loss, max_new_tokens=MAX_NEW,
    )  # fmt: skip
    objective = GRPO(cfg)

    def target_logp(p):
        logits = trainer.mdef.apply(p, batch["inputs"], batch["positions"], batch["segment_ids"])[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / cfg.temperature, axis=-1)
        return jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]

    def direct(p):
        mask = batch["loss_mask"].astype(jnp.float32)
        lp, ref = target_logp(p) * mask, target_logp(reference) * mask
        ratio = jnp.exp(lp - batch["old_logp"])
        a = batch["advantages"]
        pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        token = pg + BETA * (jnp.exp(ref - lp) - (ref - lp) - 1)
        if loss == "grpo":
            return ((token * mask).sum(-1) / mask.sum(-1)).mean()
        return (token * mask).sum() / mask.sum()

    both = jax.jit(
        lambda p, r, b: (
            summed_grads(trainer.mdef, p, b, 0.0, objective, frozen=r, split=ReferenceCopy()),
            jax.value_and_grad(direct)(p),
        )
    )
    (grads, sums), (expected, expected_grads) = both(params, reference, batch)
    np.testing.assert_allclose(sums.loss / sums.count, expected, rtol=1e-5)
    for (path, g), e in zip(
        jax.tree.leaves_with_path(grads), jax.tree.leaves(expected_grads), strict=True
    ):
        np.testing.assert_allclose(
            g / sums.count, e, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )
    assert sums.sums["grpo/kl"] > 0


def test_rewards_builtin_and_a_missing_function_named():
    from maxtrain.common.errors import UserError
    from maxtrain.posttrain.rewards import Rewards

    rewards = Rewards({"exact": 1.0, "format": 0.5})
    total, means, first = rewards(["q"] * 4, [" 15.", " 15. more", "15", " 16.\nQ"], [" 15."] * 4)
    # the first line is the answer: " 15. more" is neither the answer nor its shape
    np.testing.assert_allclose(total, [1.5, 0.0, 0.0, 0.5])
    np.testing.assert_array_equal(first, [1, 0, 0, 0])
    assert means == {"exact": 0.25, "format": 0.5}
    with pytest.raises(UserError, match="train.grpo.rewards: math has no function 'nothing'"):
        Rewards({"math:nothing": 1.0})
