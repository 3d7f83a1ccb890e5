"""The sections of how a run proceeds: `train:` (steps, batch, eval, faults), `profile:`, `run:`
(name, output, seed, cache) and `distributed:` (how a process joins a multi-process run).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveOrMinusOne,
    Section,
)


class DPOConfig(Section):
    """train.task dpo: direct preference optimisation against the frozen start checkpoint."""

    beta: PositiveFloat = 0.1  # how far the policy may move from the reference (KL weight)
    loss: Literal["sigmoid", "ipo"] = "sigmoid"  # DPO's logistic loss, or IPO's squared one


class GRPOConfig(Section):
    """train.task grpo: group relative policy optimisation with verifiable rewards
    (maxtrain/posttrain/grpo.py, docs/rl.md). Each step samples group_size completions of
    train.global_batch_size / group_size prompts from the current policy."""

    group_size: int = Field(default=8, ge=2)  # completions per prompt (G): the advantage's group
    temperature: PositiveFloat = 1.0  # sampling temperature; the policy's log-probs use it too
    top_p: float = Field(default=1.0, gt=0, le=1)  # nucleus sampling (1: every token)
    max_new_tokens: int = Field(default=16, gt=0)  # longest completion (Dr.GRPO's normaliser)
    stop: list[Annotated[str, Field(min_length=1)]] = []  # strings that end a completion
    clip_low: NonNegativeFloat = 0.2  # the ratio's clip below: 1 - clip_low
    clip_high: NonNegativeFloat = 0.2  # above: 1 + clip_high (DAPO's clip-higher: > clip_low)
    kl: Literal["none", "k3"] = "none"  # KL penalty against the start checkpoint (k3 estimator)
    kl_beta: NonNegativeFloat = 0.04  # its weight, with kl k3
    # grpo: mean over each completion's tokens, then over completions; dr_grpo: token sums
    # over completions x max_new_tokens, advantages not divided by the group's std; dapo: token
    # sums over all completion tokens
    loss: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    updates_per_rollout: int = Field(default=1, gt=0)  # optimizer steps on each rollout batch
    # name (built-in: exact, format; maxtrain/posttrain/rewards.py) or module:function -> weight
    rewards: dict[
        Annotated[str, Field(min_length=1)], Annotated[float, Field(allow_inf_nan=False)]
    ] = {"exact": 1.0}  # a weight may be negative: a penalty
    eval_prompts: int = Field(default=64, gt=0)  # held-out prompts scored (greedy) per eval


class TrainConfig(Section):
    """How long and on what batches the run trains, its objective, evaluation and faults."""

    # pretrain and sft: next-token loss on loss_mask (sft data masks all but the assistant);
    # dpo: preference pairs against a frozen reference (maxtrain/posttrain/dpo.py); grpo:
    # reinforcement learning on sampled completions of prompts (maxtrain/posttrain/grpo.py)
    task: Literal["pretrain", "sft", "dpo", "grpo"] = "pretrain"
    dpo: DPOConfig = DPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    steps: int = Field(default=300, gt=0)
    global_batch_size: int = Field(default=16, gt=0)  # sequences per optimizer step
    seq_len: int = Field(default=128, gt=0)
    grad_accum_steps: int = Field(default=1, gt=0)
    z_loss: NonNegativeFloat = 0.0
    eval_every: int = Field(default=100, ge=0)  # 0 disables eval
    eval_steps: int = Field(default=4, gt=0)
    # log-likelihood tasks scored at every eval (maxtrain/evaluation/): committed task names
    # (maxtrain/evaluation/tasks/) or task directories / JSONL files; [] = none
    eval_tasks: list[Annotated[str, Field(min_length=1)]] = []
    eval_shots: int = Field(default=0, ge=0)  # solved train examples before each task prompt
    log_every: int = Field(default=10, gt=0)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss stops, or skips the update
    # skip: more non-finite steps in a row than this stop the run as `stop` does (a run that
    # skips every step would otherwise go on in silence)
    max_consecutive_skips: int = Field(default=10, gt=0)


class ProfileConfig(Section):
    """A profile of a few steps (jax.profiler), written under the run directory."""

    start_step: PositiveOrMinusOne = -1  # -1: no profile
    num_steps: int = Field(default=3, gt=0)


class RunConfig(Section):
    """The run itself: its name and directory, its seed, the compilation cache, pre-flight."""

    name: str = Field(default="default", min_length=1)
    output_dir: str = "runs"
    seed: NonNegativeInt = 0
    # JAX's persistent compilation cache (maxtrain/training/compile_cache.py): None =
    # $MAXTRAIN_CACHE or
    # ~/.cache/maxtrain, under compilation/; "" = off.
    compilation_cache_dir: str | None = None
    # The memory pre-flight (maxtrain/analysis/preflight.py): a run whose memory estimate is
    # well beyond its devices' memory (host RAM on CPU) is refused before anything is
    # allocated or written. false: start anyway.
    check_memory: bool = True
    # The device kind the config is written for, as jax names it (a recipe's chip: "TPU v5
    # lite", "NVIDIA H100 80GB HBM3"): `tools/benchmark.py --dry-run` checks the memory
    # estimate against it unless --device names another. null: this host's devices.
    device: str | None = None


class DistributedConfig(Section):
    """How this process joins a multi-process run (maxtrain/parallel/distributed.py).

    All null: jax detects the cluster (Cloud TPU, SLURM, Open MPI, Kubernetes) when it runs in
    one, else the run is a single process. Any key set is passed on; jax fills in the rest.
    """

    coordinator_address: str | None = None  # "host:port" of process 0's coordinator service
    num_processes: int | None = Field(default=None, gt=0)
    process_id: int | None = Field(default=None, ge=0)
    initialization_timeout_s: int = Field(default=300, gt=0)
    # A process that stops answering for this long is declared dead, and every other process
    # then exits with an error instead of waiting forever in a collective.
    heartbeat_timeout_s: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _check(self) -> DistributedConfig:
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"distributed.coordinator_address must be host:port, e.g. 10.0.0.1:1234 "
                    f"(got {self.coordinator_address!r})"
                )
        n, i = self.num_processes, self.process_id
        if n is not None and i is not None and i >= n:
            raise ValueError(
                f"distributed.process_id ({i}) must be below distributed.num_processes ({n})"
            )
        return self
