"""GRPO's batches: completions sampled from the trainer's current parameters, scored, with
group-relative advantages and the policy's log-probabilities (the objective: grpo.py).

`Rollouts` is the train loop's batch iterator for train.task grpo (the loop is unchanged:
it calls next() after each step returns). Each next() that starts a rollout
  1. takes the next prompts (data/prompts.py) and samples group_size completions of each with
     maxtrain's own generation (inference/decode.py: prefill, then decode with the KV cache),
     reading the trainer's parameters where the state holds them: no copy, no sync;
  2. scores them (rewards.py) and turns the rewards into group advantages;
  3. recomputes each completion token's log-probability with the objective's own forward
     (grpo.policy_logps) on the same parameters: the old log-probabilities the ratio divides
     by, so that the first update's ratio is 1 up to the two programs' rounding (reported as
     grpo/ratio_dev); the sampler's own log-probabilities (decode's, through the KV cache) are
     compared with them and the largest difference reported (rollout/logp_diff).
With train.grpo.updates_per_rollout K it returns the same batch K times. A rollout's sampling
key derives from (run.seed, rollout index), so a resumed run samples what an uninterrupted one
does; the state saved with a checkpoint is the prompts' position, the number of batches
returned and, mid-rollout, the rollout itself.

This module uses inference, which sits above training (docs/architecture.md): the entry point
hands `on_policy` to the loop (maxtrain/train.py).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from maxtrain.config import ConfigError
from maxtrain.data import chat
from maxtrain.data.grain_pipeline import derive_seed
from maxtrain.data.prompts import Prompt, PromptStream
from maxtrain.inference.decode import generate
from maxtrain.inference.loading import LoadedModel
from maxtrain.inference.sampling import Sampling
from maxtrain.parallel.mesh import sharding_rules
from maxtrain.posttrain.grpo import group_advantages, policy_logps
from maxtrain.posttrain.rewards import Rewards

FLOAT_KEYS = ("old_logp", "advantages")


def completion_rows(
    prompts: list[tuple[int, ...]], completions: list[list[int]], seq_len: int
) -> dict[str, np.ndarray]:
    """Rows of prompt + completion, right-padded to seq_len: next-token inputs and targets,
    loss_mask 1 on the completion's targets, one segment, positions from 0."""
    rows = len(prompts)
    out = {k: np.zeros((rows, seq_len), np.int32) for k in ("inputs", "targets", "loss_mask")}
    out["segment_ids"] = np.zeros((rows, seq_len), np.int32)
    out["positions"] = np.zeros((rows, seq_len), np.int32)
    for r, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens = np.asarray([*prompt, *completion], np.int32)
        n = len(tokens) - 1
        out["inputs"][r, :n], out["targets"][r, :n] = tokens[:-1], tokens[1:]
        out["loss_mask"][r, len(prompt) - 1 : n] = 1
        out["segment_ids"][r, :n] = 1
        out["positions"][r, :n] = np.arange(n)
    return out


class Rollouts:
    """The train loop's iterator of GRPO batches (module docstring)."""

    def __init__(self, trainer: Any, prompts: PromptStream):
        cfg = trainer.cfg
        self.trainer, self.prompts, self.grpo = trainer, prompts, cfg.train.grpo
        if cfg.mesh.stage * cfg.mesh.dcn.stage > 1:
            raise ConfigError("train.task=grpo does not sample through pipeline stages yet")
        longest = max(len(p.tokens) for p in [*prompts.train, *prompts.held_out])
        if longest + self.grpo.max_new_tokens - 1 > cfg.train.seq_len:
            raise ConfigError(
                f"the longest prompt ({longest} tokens) and train.grpo.max_new_tokens "
                f"({self.grpo.max_new_tokens}) do not fit train.seq_len={cfg.train.seq_len}"
            )
        self.tokenizer = chat.load_tokenizer(cfg.data.tokenizer)
        self.rewards = Rewards(self.grpo.rewards)
        self.sampling = Sampling(self.grpo.temperature, 0, self.grpo.top_p)
        self.programs: dict = {}  # generation's compiled programs, by shape
        self.served = 0  # batches returned
        self.current: dict[str, np.ndarray] | None = None
        self.last_metrics: dict[str, float] = {}
        self.last_start: float | None = None  # the previous rollout's start, and its seconds
        self.last_rollout_s = 0.0
        rules, mesh = cfg.mesh.rules, trainer.mesh
        temperature, split, mdef = self.grpo.temperature, trainer.split, trainer.mdef

        def logps(params, frozen, batch):
            with sharding_rules(mesh, rules):
                return policy_logps(mdef, split.combine(params, frozen), batch, temperature)[0]

        shardings = trainer.shardings
        self._logps = jax.jit(
            logps, in_shardings=(shardings.params, shardings.frozen, trainer.batch_sharding)
        )

    # ---- the iterator -------------------------------------------------------------------------

    def __iter__(self) -> Rollouts:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.served % self.grpo.updates_per_rollout == 0 or self.current is None:
            self.current = self._rollout(self.served // self.grpo.updates_per_rollout)
        self.served += 1
        return self.current

    def get_state(self) -> dict:
        mid = self.served % self.grpo.updates_per_rollout != 0
        rollout = None
        if mid and self.current is not None:  # its sampler's parameters are gone: keep it
            rollout = {k: v.tolist() for k, v in self.current.items()}
            rollout["metrics"] = self.last_metrics  # what its further steps log
        return {"prompts": self.prompts.get_state(), "served": self.served, "rollout": rollout}

    def set_state(self, state: dict) -> None:
        self.prompts.set_state(state["prompts"])
        self.served = int(state["served"])
        saved = state.get("rollout")
        self.current = None
        if saved is not None:
            saved = dict(saved)
            self.last_metrics = saved.pop("metrics")
            self.current = {
                k: np.asarray(v, np.float32 if k in FLOAT_KEYS else np.int32)
                for k, v in saved.items()
            }

    def batch_metrics(self) -> dict[str, float]:
        """The rollout metrics of the batch last returned."""
        return self.last_metrics

    # ---- sampling and scoring -----------------------------------------------------------------

    def _sampler(self) -> LoadedModel:
        """The trainer's model and current parameters, as generation takes them."""
        t = self.trainer
        return LoadedModel(t.cfg, t.mdef, t.model_params(), t.mesh, t.cfg.run_dir, 0)

    def _complete(
        self, prompts: list[Prompt], sampling: Sampling, seed: int
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        stops = self.grpo.stop
        decode = self.tokenizer.decode

        def stop_check(row: int, new: list[int]) -> bool:
            text = decode(new)
            return any(s in text for s in stops)

        out = generate(
            self._sampler(),
            [p.tokens for p in prompts],
            self.grpo.max_new_tokens,
            sampling=sampling,
            seed=seed,
            stop_ids=(self.tokenizer.eos_id,),
            stop_check=stop_check if stops else None,
            programs=self.programs,
        )
        texts = [decode([t for t in new if t != self.tokenizer.eos_id]) for new in out.new_tokens]
        return out.new_tokens, out.logprobs, texts

    def _rollout(self, index: int) -> dict[str, np.ndarray]:
        trainer, G = self.trainer, self.grpo.group_size
        jax.block_until_ready(trainer.state.params)  # the step's time is not sampling's
        started = time.perf_counter()
        # The previous rollout's share of its whole cycle: its own seconds over the time from
        # its start to this one's, which holds the steps trained on its batch (this rollout's
        # own steps are still to come, so its share is the next one's to report).
        share = (
            None if self.last_start is None else self.last_rollout_s / (started - self.last_start)
        )
        prompts = [p for p in next(self.prompts) for _ in range(G)]
        seed = derive_seed(trainer.cfg.run.seed, "rollout", index)
        completions, sampler_logps, texts = self._complete(prompts, self.sampling, seed)
        sampled = time.perf_counter()
        rewards, per_reward, first_scores = self.rewards(
            [p.text for p in prompts], texts, [p.answer for p in prompts]
        )
        advantages = group_advantages(rewards, G, scale=self.grpo.loss != "dr_grpo")
        batch = completion_rows([p.tokens for p in prompts], completions, trainer.cfg.train.seq_len)
        mask = batch["loss_mask"].astype(bool)
        batch["advantages"] = np.where(mask, advantages[:, None], 0).astype(np.float32)
        old = trainer.global_batch({**batch, "old_logp": np.zeros(mask.shape, np.float32)})
        batch["old_logp"] = np.asarray(self._logps(trainer.state.params, trainer.state.frozen, old))
        sampler = np.zeros(mask.shape, np.float32)
        for r, lp in enumerate(sampler_logps):
            start = len(prompts[r].tokens) - 1
            sampler[r, start : start + len(lp)] = lp
        generated = sum(len(c) for c in completions)
        elapsed = time.perf_counter() - started
        groups = rewards.reshape(-1, G)
        self.last_metrics = {
            "reward": float(rewards.mean()),
            "reward_std": float(groups.std(axis=1).mean()),  # within groups: what A learns from
            **{f"reward/{name}": v for name, v in per_reward.items()},
            # groups whose rewards differ: the only ones with a gradient
            "mixed_groups": float((groups.max(axis=1) > groups.min(axis=1)).mean()),
            # pass@G: groups where the first reward (exact, by default) scored 1 at least once
            "pass_at_group": float((first_scores.reshape(-1, G).max(axis=1) >= 1).mean()),
            "response_length": generated / len(completions),
            "rollout_tokens_per_s": generated / max(sampled - started, 1e-9),
            "rollout_s": elapsed,
            "logp_diff": float(np.abs(sampler - batch["old_logp"])[mask].max()),
        }
        if share is not None:
            self.last_metrics["rollout_share"] = share
        self.last_start, self.last_rollout_s = started, elapsed
        return batch

    def evaluate(self) -> dict[str, float]:
        """Held-out prompts (up to train.grpo.eval_prompts), decoded greedily: the share whose
        completion the first reward (exact, by default) scores 1, and the mean total reward."""
        prompts = self.prompts.held_out[: self.grpo.eval_prompts]
        _, _, texts = self._complete(prompts, Sampling(), 0)
        rewards, _, first_scores = self.rewards(
            [p.text for p in prompts], texts, [p.answer for p in prompts]
        )
        return {"accuracy": float(first_scores.mean()), "reward": float(rewards.mean())}


def on_policy(trainer: Any, train_batches: Any) -> Any:
    """The loop's batches for the trainer's task: GRPO's rollouts over its prompts, else the
    data's batches as they are."""
    if trainer.cfg.train.task != "grpo":
        return train_batches
    return Rollouts(trainer, train_batches)
