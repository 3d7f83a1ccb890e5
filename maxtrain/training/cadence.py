"""What the train loop does besides stepping, each deciding its own cadence.

The loop (training/loop.py) steps and hands each component the step: the profiler starts and
stops its trace, the step log writes a window's metrics every train.log_every steps, the
periodic evaluation scores the held-out streams every train.eval_every steps, and the
checkpointer (checkpointing/) saves when its tiers are due. None of them knows the others.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from maxtrain.config import Config
from maxtrain.training import metrics as metrics_lib


def say(is_writer: bool, line: str) -> None:
    """A console line from the process that writes (process 0)."""
    if is_writer:
        print(line, flush=True)


def warn(is_writer: bool, line: str) -> None:
    """A warning line on stderr from the process that writes."""
    if is_writer:
        print(f"maxtrain: warning: {line}", file=sys.stderr, flush=True)


class Profiler:
    """A JAX trace of profile.num_steps steps from profile.start_step (-1: none) into
    <run_dir>/profile."""

    def __init__(self, cfg: Config):
        self.first = cfg.profile.start_step
        self.last = self.first + cfg.profile.num_steps - 1
        self.trace_dir = str(cfg.run_dir / "profile")

    def before_step(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.trace_dir)

    def after_step(self, step: int, state: Any) -> None:
        if self.first > 0 and step == self.last:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()


class StepLog:
    """The training metrics of a window of steps, written (console, TensorBoard, JSONL) every
    train.log_every steps, at the last step and when the run is stopping: the window's step
    time, the share of it spent waiting for data, throughput and MFU, and the MoE drop warning
    over the window's steps. Steps run asynchronously; only a written step synchronises."""

    def __init__(self, cfg: Config, writer: metrics_lib.MetricsWriter, trainer, is_writer: bool):
        self.cfg, self.writer, self.is_writer = cfg, writer, is_writer
        self.num_devices, self.flops_per_token = trainer.mesh.size, trainer.flops_per_token
        self.peak = metrics_lib.peak_tflops(jax.devices()[0].device_kind)
        self.last: dict[str, Any] = {}  # the latest written values, "train/<name>"
        self.restart_clock()

    def restart_clock(self) -> None:
        """A new window: what ran before (an evaluation, a written line) is not step time."""
        self.start, self.steps, self.data_wait, self.dropped = time.perf_counter(), 0, 0.0, []

    def fetch(self, next_batch: Callable[[], Any]) -> Any:
        """The next batch, its wait counted: the host builds it while the device steps."""
        t0 = time.perf_counter()
        batch = next_batch()
        self.data_wait += time.perf_counter() - t0
        return batch

    def after_step(self, step: int, step_metrics: dict, stopping: bool) -> None:
        self.steps += 1
        if "moe/dropped" in step_metrics:
            self.dropped.append(step_metrics["moe/dropped"])  # still on device
        train = self.cfg.train
        if step % train.log_every == 0 or step == train.steps or stopping:
            self._write(step, step_metrics)
            self.restart_clock()

    def _write(self, step: int, step_metrics: dict) -> None:
        fetched = jax.device_get(step_metrics)
        # Arrays (e.g. moe/load, per layer and expert) are histograms, not scalars.
        arrays = {k: fetched.pop(k) for k in list(fetched) if np.ndim(fetched[k]) > 0}
        if arrays:
            self.writer.write_histograms(step, arrays, "train")
        elapsed = time.perf_counter() - self.start  # device_get above synchronised
        step_time = elapsed / self.steps
        scalars = {
            **{k: float(v) for k, v in fetched.items()},
            "step_time_s": step_time,
            "data_wait_fraction": self.data_wait / elapsed,
            **metrics_lib.step_stats(
                step_time, self.cfg.tokens_per_step, self.num_devices, self.flops_per_token,
                self.peak,
            ),
        }  # fmt: skip
        self.writer.write(step, scalars, prefix="train")
        say(self.is_writer, metrics_lib.format_console_line(step, self.cfg.train.steps, scalars))
        if self.dropped and (
            line := metrics_lib.drop_warning(np.mean(jax.device_get(self.dropped)))
        ):
            warn(self.is_writer, line)
        self.last.update({f"train/{k}": v for k, v in scalars.items()})


class PeriodicEval:
    """The held-out loss (and train.eval_tasks) every train.eval_every steps and at the last
    step; 0 disables it."""

    def __init__(self, cfg: Config, run_eval: Callable[[], dict], writer, is_writer: bool):
        self.every, self.steps = cfg.train.eval_every, cfg.train.steps
        self.run_eval, self.writer, self.is_writer = run_eval, writer, is_writer
        self.last: dict[str, Any] = {}  # the latest results, "eval/<name>"

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.steps)

    def after_step(self, step: int) -> None:
        results = self.run_eval()
        self.writer.write(step, results, prefix="eval")
        say(self.is_writer, format_eval(step, results))
        self.last.update({f"eval/{k}": v for k, v in results.items()})


def format_eval(step: int, ev: dict[str, float]) -> str:
    per_source = ", ".join(
        f"{k.removesuffix('/loss')} {v:.3f}" for k, v in ev.items() if k.endswith("/loss")
    )
    if "loss" not in ev:  # no held-out batches (GRPO scores held-out prompts)
        scores = ", ".join(f"{k} {v:.3f}" for k, v in ev.items())
        return f"eval  step {step}: {scores}"
    line = f"eval  step {step}: loss {ev['loss']:.4f}, ppl {ev['perplexity']:.2f}"
    line = f"{line} ({per_source})" if per_source else line
    # The objective's own sums (DPO: dpo/accuracy, dpo/reward_margin), not a task's scores.
    task_scores = ("/loss", "/acc", "/acc_norm", "/loglik")
    own = ", ".join(
        f"{k} {v:.3f}" for k, v in ev.items() if "/" in k and not k.endswith(task_scores)
    )
    line = f"{line}, {own}" if own else line
    tasks = ", ".join(f"{k} {v:.3f}" for k, v in ev.items() if k.endswith("/acc"))
    return f"{line}; {tasks}" if tasks else line
