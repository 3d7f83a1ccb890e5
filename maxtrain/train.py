"""Entry point and the single train loop: `python -m maxtrain.train CONFIG.yml [key=value ...]`.

Read top to bottom: load the config, build the mesh and the sharded train state, compile one
step, then loop (batch -> step -> metrics -> eval/profile) and write a summary.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from maxtrain import config as config_lib
from maxtrain import metrics as metrics_lib
from maxtrain import optim
from maxtrain.config import Config, ConfigError
from maxtrain.data import batch_sharding, to_global
from maxtrain.data.errors import DataError
from maxtrain.data.pipeline import STREAMS, EvalStream
from maxtrain.mesh import batch_degree, build_mesh, sharding_rules
from maxtrain.state import ModelDef, TrainState, init_state
from maxtrain.train_step import eval_step, train_step


@dataclass
class Trainer:
    """The compiled pieces of a run, shared by the train loop and tools/benchmark.py."""

    cfg: Config
    mesh: Mesh
    mdef: ModelDef
    state: TrainState
    batch_sharding: NamedSharding
    step_fn: Any  # (state, batch) -> (state, metrics), donates state
    eval_fn: Any  # (params, batch) -> {nll_sum, tokens}
    flops_per_token: float


def check_batch(cfg: Config, mesh: Mesh) -> None:
    degree = batch_degree(cfg.mesh.rules, mesh)
    if cfg.micro_batch_size % degree:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} over "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} gives micro-batches of "
            f"{cfg.micro_batch_size} sequences, not divisible by the data-parallel degree "
            f"{degree} (mesh axes {', '.join(cfg.mesh.rules.get('batch', []))})"
        )
    if cfg.train.global_batch_size % jax.process_count():
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by the "
            f"{jax.process_count()} processes"
        )


def build_trainer(cfg: Config, devices: list[jax.Device] | None = None) -> Trainer:
    mesh = build_mesh(cfg.mesh, devices)
    check_batch(cfg, mesh)
    tx, lr_schedule = optim.build(cfg.optim, cfg.train.steps)
    with sharding_rules(mesh, cfg.mesh.rules):
        state, mdef, shardings = init_state(cfg, mesh, tx)
    data_sharding = batch_sharding(mesh, cfg.mesh.rules)
    step = functools.partial(
        train_step,
        mdef=mdef,
        tx=tx,
        lr_schedule=lr_schedule,
        grad_accum_steps=cfg.train.grad_accum_steps,
        z_loss=cfg.train.z_loss,
    )
    step_fn = jax.jit(
        _with_rules(step, mesh, cfg),
        in_shardings=(shardings, data_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        _with_rules(functools.partial(eval_step, mdef=mdef), mesh, cfg),
        in_shardings=(shardings.params, data_sharding),
    )
    flops = metrics_lib.train_flops_per_token(cfg.model, cfg.train.seq_len)
    return Trainer(cfg, mesh, mdef, state, data_sharding, step_fn, eval_fn, flops)


def _with_rules(fn, mesh: Mesh, cfg: Config):
    """Traces `fn` with the config's logical-axis rules active (for activation constraints)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with sharding_rules(mesh, cfg.mesh.rules):
            return fn(*args, **kwargs)

    return wrapped


def data_streams(cfg: Config, start_step: int = 0) -> tuple[Any, list[EvalStream]]:
    """(train iterator of this host's batches from start_step, held-out eval streams).

    data.kind picks the builder (maxtrain/data/pipeline.py STREAMS). For kind grain the train
    iterator also has get_state()/set_state() for an exact resume.
    """
    return STREAMS[cfg.data.kind](cfg, start_step)


def evaluate(trainer: Trainer, eval_streams: list[EvalStream]) -> dict[str, float]:
    """Loss per held-out stream over train.eval_steps batches, and overall.

    Each stream restarts from its beginning, so evals at different steps score the same tokens
    and are comparable. The overall loss weights each stream's loss by its source weight: the
    expected loss per token of the training mixture, whatever the sources' eval sizes.
    """
    weighted, total_weight, per_stream = 0.0, 0.0, {}
    for stream in eval_streams:
        batches = stream.batches()
        nll, tokens = [], []
        for _ in range(trainer.cfg.train.eval_steps):
            out = trainer.eval_fn(
                trainer.state.params, to_global(next(batches), trainer.batch_sharding)
            )
            nll.append(out["nll_sum"])  # device scalars: fetched once per stream, below
            tokens.append(out["tokens"])
        loss = float(sum(jax.device_get(nll))) / max(float(sum(jax.device_get(tokens))), 1.0)
        if stream.name:
            per_stream[f"{stream.name}/loss"] = loss
        weighted, total_weight = weighted + stream.weight * loss, total_weight + stream.weight
    loss = weighted / total_weight
    return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), **per_stream}


def run(cfg: Config) -> dict[str, Any]:
    """Trains per the config; returns the final metrics summary (also written to the run dir)."""
    # Config and data mistakes surface in these two calls, before anything is written.
    trainer = build_trainer(cfg)
    train_batches, eval_streams = data_streams(cfg)
    is_writer = jax.process_index() == 0
    run_dir = cfg.run_dir
    if is_writer:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yml").write_text(config_lib.to_yaml(cfg))
    num_devices = trainer.mesh.size
    peak = metrics_lib.peak_tflops(jax.devices()[0].device_kind)
    writer = metrics_lib.MetricsWriter(run_dir, is_writer=is_writer)
    _print(
        is_writer,
        f"maxtrain: {cfg.model_name}, {num_devices} devices "
        f"({jax.devices()[0].device_kind}), mesh {dict(trainer.mesh.shape)}, run dir {run_dir}",
    )

    profile = cfg.profile
    next_batch = to_global(next(train_batches), trainer.batch_sharding)
    window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0
    last: dict[str, Any] = {}
    for step in range(1, cfg.train.steps + 1):
        if step == profile.start_step:
            jax.profiler.start_trace(str(run_dir / "profile"))
        trainer.state, step_metrics = trainer.step_fn(trainer.state, next_batch)
        # The step runs asynchronously: the host builds the next batch meanwhile.
        t0 = time.perf_counter()
        if step < cfg.train.steps:
            next_batch = to_global(next(train_batches), trainer.batch_sharding)
        data_wait += time.perf_counter() - t0
        window_steps += 1
        if profile.start_step > 0 and step == profile.start_step + profile.num_steps - 1:
            jax.block_until_ready(trainer.state)
            jax.profiler.stop_trace()

        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            fetched = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
            elapsed = time.perf_counter() - window_start  # device_get above synchronised
            step_time = elapsed / window_steps
            scalars = {
                **fetched,
                "step_time_s": step_time,
                "data_wait_fraction": data_wait / elapsed,
                **metrics_lib.step_stats(
                    step_time, cfg.tokens_per_step, num_devices, trainer.flops_per_token, peak
                ),
            }
            writer.write(step, scalars, prefix="train")
            _print(is_writer, metrics_lib.format_console_line(step, cfg.train.steps, scalars))
            last = scalars
            window_start, window_steps, data_wait = time.perf_counter(), 0, 0.0

        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
            ev = evaluate(trainer, eval_streams)
            writer.write(step, ev, prefix="eval")
            _print(is_writer, _format_eval(step, ev))
            last.update({f"eval_{k}": v for k, v in ev.items()})
            window_start = time.perf_counter()  # keep eval time out of step time

    writer.close()
    summary = {"step": cfg.train.steps, **{k: v for k, v in last.items() if v is not None}}
    if is_writer:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _format_eval(step: int, ev: dict[str, float]) -> str:
    per_source = ", ".join(
        f"{k.removesuffix('/loss')} {v:.3f}" for k, v in ev.items() if k.endswith("/loss")
    )
    line = f"eval  step {step}: loss {ev['loss']:.4f}, ppl {ev['perplexity']:.2f}"
    return f"{line} ({per_source})" if per_source else line


def _print(is_writer: bool, line: str) -> None:
    if is_writer:
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m maxtrain.train CONFIG.yml [key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = config_lib.load(argv[0], argv[1:])
        run(cfg)
    except (ConfigError, DataError) as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
