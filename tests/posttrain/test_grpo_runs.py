"""GRPO end to end on the tiny model: the rollouts' rows and log-probabilities (sampler vs
trainer), and the CLI's runs resuming bit for bit, a rollout's second update included."""

import json
import os

import jax
import numpy as np
import pytest
from support import runs

from maxtrain import config as config_lib
from maxtrain.data.corpora.sums import problems
from maxtrain.data.streams import data_streams
from maxtrain.posttrain.rollout import Rollouts
from maxtrain.training.loop import build_trainer

# The tolerance of the sampler's log-probabilities (decode: prefill, then one token at a time
# through the KV cache) against the trainer's (one forward over the whole row): the same
# float32 math summed in other orders. Measured at 9.5e-7 on the tiny model (CPU).
SAMPLER_TOLERANCE = 1e-5


# A random model never answers a sum: a user's reward (train.grpo.rewards' module:function) that
# differs between its samples gives the steps a gradient.
REWARD_MODULE = """
def parity(prompt, completion, answer):
    return float(len(completion) % 2)
"""


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo") / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in problems(40, 1, 0)))
    (path.parent / "grpo_test_rewards.py").write_text(REWARD_MODULE)
    return path


@pytest.fixture(autouse=True)
def reward_importable(prompts_file, monkeypatch):
    """The reward's module importable here and in the runs' processes."""
    monkeypatch.syspath_prepend(str(prompts_file.parent))
    paths = [str(prompts_file.parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


def _args(prompts_file, *extra):
    return [
        "model_name=tiny",
        "model.vocab_size=1024",  # the default tokenizer's
        "train.task=grpo",
        f"data.sources=[{{name: sums, path: {prompts_file}, format: prompts}}]",
        "data.eval_fraction=0.2",
        "train.global_batch_size=8",
        "train.grpo.group_size=4",
        "train.grpo.max_new_tokens=4",
        "train.grpo.temperature=1.5",  # a random model's samples differ: rewards vary
        "train.grpo.rewards={exact: 1.0, 'grpo_test_rewards:parity': 0.5}",
        "train.seq_len=32",
        "train.log_every=1",
        "optim.warmup_steps=0",
        "optim.lr=1e-2",
        *extra,
    ]


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_rollout_rows_and_sampler_log_probs_match_the_trainer(prompts_file, tmp_path, model):
    """On tiny-moe the sampler's router (decode, a token at a time) and the trainer's (the
    whole row) choose from hidden states that differ in rounding: a choice that flipped would
    show as a log-probability far outside the tolerance (measured: 9.5e-7, as dense)."""
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [
            *_args(prompts_file),
            f"model_name={model}",
            "train.eval_every=0",
            f"run.output_dir={tmp_path}",
        ],
    )
    prompts, _ = data_streams(cfg)
    trainer = build_trainer(cfg, jax.devices()[:1])
    rollouts = Rollouts(trainer, prompts)
    assert rollouts._sampler().params is trainer.state.params  # read in place, no copy
    batch = next(rollouts)
    metrics = rollouts.batch_metrics()
    assert metrics["logp_diff"] <= SAMPLER_TOLERANCE
    mask = batch["loss_mask"].astype(bool)
    lengths = mask.sum(1)
    assert ((lengths >= 1) & (lengths <= cfg.train.grpo.max_new_tokens)).all()
    # the completion's targets follow the prompt, each input is the previous target
    np.testing.assert_array_equal(
        batch["inputs"][:, 1:][mask[:, 1:]], batch["targets"][:, :-1][mask[:, 1:]]
    )
    assert (batch["old_logp"][mask] < 0).all() and (batch["old_logp"][~mask] == 0).all()
    # advantages are constant along a completion and sum to 0 over each group of 4
    per_row = batch["advantages"].max(1) + batch["advantages"].min(1)
    np.testing.assert_allclose(per_row.reshape(-1, 4).sum(1), 0, atol=1e-5)
    assert metrics["response_length"] == lengths.mean()


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timing = ("_s", "per_s", "share", "_fraction", "_per_device")
    return {
        (r["step"], k): v
        for r in map(json.loads, lines)
        for k, v in r.items()
        if k != "step" and not k.endswith(timing)
    }


def test_two_runs_of_two_steps_equal_one_of_four_bit_for_bit(prompts_file, tmp_path):
    """updates_per_rollout 2 with a stop at step 3: the saved state holds the rollout the
    fourth step updates on again; the sampling keys come from (seed, rollout)."""
    common = _args(
        prompts_file, "train.grpo.updates_per_rollout=2", "optim.schedule_steps=4",
        "train.eval_every=2", "checkpoint.persistent.every_steps=100",
    )  # fmt: skip
    whole = tmp_path / "whole"
    runs.run_to_end(whole, [*common, "train.steps=4"])
    parts = tmp_path / "parts"
    runs.run_to_end(parts, [*common, "train.steps=3"])
    runs.run_to_end(parts, [*common, "train.steps=4"])
    expected, got = _records(whole), _records(parts)
    # the first part's last step evaluates, as a run's last step does; the whole run's does not
    got = {k: v for k, v in got.items() if not (k[0] == 3 and k[1].startswith("eval/"))}
    assert expected == got
    assert expected[(4, "train/grpo/ratio_dev")] > 0  # the second update moved the policy
    assert expected[(3, "train/grpo/ratio_dev")] < 1e-5  # a rollout's first: ratio 1


def _one_step(prompts_file, tmp_path, mesh, devices):
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [*_args(prompts_file), "train.eval_every=0", f"run.output_dir={tmp_path}", *mesh],
    )
    prompts, _ = data_streams(cfg)
    trainer = build_trainer(cfg, devices)
    rollouts = Rollouts(trainer, prompts)
    batch = next(rollouts)
    before = jax.device_get(trainer.state.params)
    trainer.state, metrics = trainer.step_fn(trainer.state, trainer.global_batch(batch))
    update = jax.tree.map(np.subtract, jax.device_get(trainer.state.params), before)
    return batch, jax.device_get(metrics), update


def test_a_step_on_fsdp_x_tensor_equals_one_device(prompts_file, tmp_path):
    """The same completions (sampling keys do not depend on the mesh), advantages and rows; old
    log-probabilities, metrics and updated parameters equal up to the reductions' order."""
    # optim.eps 1: Adam's first update is then about lr x the gradient, not lr x its sign, so
    # the updates compare as the gradients do (a sign of a gradient near 0 is rounding's)
    linear = ["optim.eps=1.0", "optim.weight_decay=0"]
    one = _one_step(prompts_file, tmp_path / "one", linear, jax.devices()[:1])
    eight = _one_step(
        prompts_file, tmp_path / "eight", [*linear, "mesh.fsdp=4", "mesh.tensor=2"],
        jax.devices()[:8],
    )  # fmt: skip
    for key in ("inputs", "targets", "loss_mask", "advantages"):
        np.testing.assert_array_equal(one[0][key], eight[0][key], err_msg=key)
    np.testing.assert_allclose(one[0]["old_logp"], eight[0]["old_logp"], atol=1e-5)
    assert one[1]["grad_norm"] > 0  # rewards differed within some group: the step moved
    for key in ("loss", "grad_norm", "grpo/clipped"):
        np.testing.assert_allclose(one[1][key], eight[1][key], rtol=1e-4, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(eight[2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * np.abs(a).max())


def test_lora_policy_measures_its_kl_against_its_base(prompts_file, tmp_path):
    """With lora.rank > 0 and the k3 KL the reference is the frozen base with the adapters off
    (the split's start, the model the run began as), not a second model: the KL is exactly 0
    at the first step (the adapters start at zero, so policy and base agree bit for bit) and
    positive once an update has moved the adapters."""
    from maxtrain.checkpointing.export import save_parameters

    plain = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", [*_args(prompts_file), f"run.output_dir={tmp_path}"]
    )
    base = save_parameters(tmp_path / "base", build_trainer(plain, jax.devices()[:1]).state.params)
    run_dir = tmp_path / "lora"
    runs.run_to_end(
        run_dir,
        [
            *_args(prompts_file),
            "lora.rank=4",
            "lora.modules=[attention,mlp]",
            f"checkpoint.load_parameters_path={base}",
            "train.grpo.kl=k3",
            "train.steps=2",
            "train.eval_every=0",
        ],
    )
    records = _records(run_dir)
    assert records[(1, "train/grpo/kl")] == 0.0
    assert records[(2, "train/grpo/kl")] > 0.0
