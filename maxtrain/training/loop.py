"""Entry point and the single train loop: `python -m maxtrain.train CONFIG.yml [key=value ...]`.

Read top to bottom: load the config, build the mesh and the sharded train state, compile one
step, then loop (batch -> step -> metrics -> eval/profile) and write a summary.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import yaml

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain.checkpointing import (
    CheckpointError,
    TieredCheckpointer,
    open_checkpointer,
    read_saved_config,
)
from maxtrain.checkpointing.common import tier_dirs
from maxtrain.checkpointing.integrity import newest_complete
from maxtrain.common.errors import DEBUG_ENV, UserError, first_line, path_first, refuse
from maxtrain.config import Config
from maxtrain.data.grain_pipeline import EvalStream
from maxtrain.data.streams import data_streams
from maxtrain.evaluation.harness import TaskEvaluator, task_evaluator
from maxtrain.evaluation.loss import held_out_loss
from maxtrain.parallel import distributed
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.surgery.initialize import initial_params
from maxtrain.training import compile_cache, discovery, run_identity, run_lock, run_summary
from maxtrain.training import metrics as metrics_lib
from maxtrain.training.cadence import PeriodicEval, Profiler, StepLog, say, warn
from maxtrain.training.compile_progress import compile_progress, devices_of
from maxtrain.training.interrupts import EXIT_STATUS, StopSignals
from maxtrain.training.nonfinite import NonFiniteLoss, NonFiniteWatch
from maxtrain.training.run_model import model_def
from maxtrain.training.state import abstract_frozen, frozen_state
from maxtrain.training.trainer import Trainer, build_trainer, checked_for_devices


def evaluate(trainer: Trainer, eval_streams: list[EvalStream]) -> dict[str, float]:
    """The objective's loss per held-out stream over train.eval_steps batches, and overall
    (evaluation/loss.py)."""
    return held_out_loss(
        lambda params, batch: trainer.eval_fn(params, trainer.state.frozen, batch),
        trainer.state.params, trainer.batch_sharding, eval_streams, trainer.cfg.train.eval_steps,
    )  # fmt: skip


def _resume_or_load(trainer: Trainer, ckpt: TieredCheckpointer | None, train_batches) -> int:
    """Restores the newest checkpoint (state and data position) and returns its step; else
    loads checkpoint.load_parameters_path into the fresh state, if set (transformed per
    init.mode: upcycling, depth upscaling), and returns 0."""
    saved = trainer.saved.abstract(trainer.state)  # checkpoints hold layers in model order
    _load_frozen(trainer)
    if ckpt is not None:
        restored = ckpt.restore_latest(saved, train_batches)
        if restored is not None:
            state, step = restored
            # Checkpoints hold no frozen base: the one _load_frozen read is kept.
            run_shardings = trainer.shardings.replace(frozen=None)
            restored_state = trainer.saved.restored(state.train_state(), run_shardings)
            trainer.state = restored_state.replace(frozen=trainer.state.frozen)
            return step
    path = trainer.cfg.checkpoint.load_parameters_path
    if path and trainer.split.loads_trained:  # else it is only the frozen part
        params = initial_params(trainer.cfg, saved.params)
        trainer.state = trainer.state.replace(
            params=trainer.saved.restored(params, trainer.shardings.params)
        )
    return 0


def _load_frozen(trainer: Trainer) -> None:
    """The split's frozen part (training/split.py: a LoRA run's base, DPO's reference), from
    checkpoint.load_parameters_path (transformed per init.mode), at every start and resume:
    checkpoints never hold it."""
    if not trainer.split.has_frozen:
        return
    cfg = trainer.cfg
    loaded = initial_params(cfg, abstract_frozen(trainer.mdef, cfg, trainer.mesh))
    trainer.state = trainer.state.replace(
        frozen=frozen_state(cfg, trainer.mdef, trainer.shardings, loaded)
    )


def _finished(cfg: Config) -> dict[str, Any] | None:
    """A run whose persistent tier holds a complete step at or past train.steps is done: says so
    and returns its step, before anything is compiled, read or written (re-running it used to
    overwrite summary.json with the bare step). None: there is training to do. The final step is
    always saved to the persistent tier, and every process reads the same one. Either way, a
    config that changes the model, data or objective the run's checkpoints were saved with is
    refused first (training/run_identity.py): it names another run."""
    if not cfg.checkpoint.enabled:
        return None
    dirs = tier_dirs(cfg.checkpoint, cfg.run_dir)
    run_identity.check_same_run(cfg, dirs.values())
    found = newest_complete(dirs["persistent"])
    if found is None or found[0] < cfg.train.steps:
        return None
    done = _complete(cfg, *found)
    if not (cfg.run_dir / run_summary.FILE).exists() and jax.process_index() == 0:
        # Killed after its final save, before the summary: write it now, under the lock (which
        # also clears one the killed trainer left filled in).
        with run_lock.held(cfg.run_dir):
            path = run_summary.write(cfg.run_dir, run_summary.from_metrics(cfg, found[0]))
        say(True, f"maxtrain: wrote the missing {path} from metrics.jsonl")
    return done


def _complete(cfg: Config, step: int, where: Any) -> dict[str, Any]:
    say(
        jax.process_index() == 0,
        f"maxtrain: run {cfg.run_dir} is complete: step {step} (train.steps={cfg.train.steps}) "
        f"is saved in {where}; nothing to do (raise train.steps to train further)",
    )
    return {"step": step}


def _keep_finite_checkpoints(ckpt: TieredCheckpointer | None, first_bad: int) -> str:
    """Moves aside the checkpoints a run stopped by non-finite losses must not resume from (the
    state saved just before the first bad step and any saved after it:
    maxtrain/training/nonfinite.py)
    and says which checkpoint a restart resumes from."""
    if ckpt is None:
        return "checkpointing is off"
    with contextlib.suppress(CheckpointError):  # the non-finite loss is the error to report
        ckpt.close()
    moved, left = ckpt.set_aside_from(first_bad - 1, "nonfinite")
    kept = (
        f"the newest finite checkpoint, step {left}, is kept and a restart resumes from it"
        if left is not None
        else "no finite checkpoint was saved"
    )
    if moved:
        steps = sorted({int(p.name.split(".")[0]) for p in moved})
        kept += (
            f" (step {', '.join(map(str, steps))}, saved from the state that gave a non-finite "
            f"loss, moved aside as {moved[0].name})"
        )
    return kept


# (trainer, the data's train iterator) -> the batches the step takes. Post-training whose
# batches are sampled from the trainer's current parameters (GRPO's rollouts:
# maxtrain/posttrain/rollout.py) wraps the data's iterator; it sits above training, so the entry
# point hands it in. Such an iterator may have batch_metrics() (host metrics of the batch it
# returned last, logged with that batch's step) and evaluate() (held-out scores, at each eval).
type OnPolicy = Callable[[Trainer, Any], Any]


def run(
    cfg: Config,
    preflight: Callable[[Config], None] | None = None,
    on_policy: OnPolicy | None = None,
) -> dict[str, Any]:
    """Trains per the config; returns the final metrics summary (also written to the run dir).

    Holds the run directory's lock (training/run_lock.py) while it trains: a second trainer on the
    same run directory refuses to start. preflight: a check that may refuse the run (UserError)
    before anything is allocated or written; `python -m maxtrain.train` passes the memory
    pre-flight (analysis/preflight.py, which sits above training and so is handed in).
    on_policy: the batches sampled from the trainer (OnPolicy), where the task has them.
    """
    started = time.perf_counter()
    distributed.initialize(cfg.distributed)  # before anything touches devices
    compile_cache.enable_compilation_cache(cfg.run.compilation_cache_dir)
    if (done := _finished(cfg)) is not None:
        return done
    if preflight is not None:
        preflight(cfg)
    # Config and data mistakes surface in these calls, before anything is written; the data's
    # first, as it needs no compilation (the state's initialisation does), and before the line
    # below: a refused input is its one error line alone.
    checked_for_devices(cfg)
    train_batches, eval_streams = data_streams(cfg)
    tasks = _task_evaluator(cfg)
    say(
        jax.process_index() == 0,
        f"maxtrain: preparing {cfg.run_dir}: the data is ready; the sharded train state compiles",
    )
    trainer = build_trainer(cfg)
    if on_policy is not None:
        train_batches = on_policy(trainer, train_batches)
    elif cfg.train.task == "grpo":
        raise UserError("train.task=grpo samples its batches: run it with python -m maxtrain.train")
    # As the user wrote it, "auto" choices included: a resume on other hardware chooses anew
    # (trainer.cfg holds this hardware's choices).
    config_yaml = config_lib.to_yaml(cfg)
    with run_lock.held(cfg.run_dir, take=jax.process_index() == 0):
        ckpt = None
        if cfg.checkpoint.enabled:
            ckpt = open_checkpointer(
                cfg.checkpoint, cfg.run_dir, config_yaml, trainer.saved.abstract(trainer.state)
            )
        try:
            return _train(trainer, ckpt, train_batches, eval_streams, started, config_yaml, tasks)
        except NonFiniteLoss as e:
            e.kept = _keep_finite_checkpoints(ckpt, e.first)
            raise
        except BaseException:
            if ckpt is not None:  # let saves in flight commit; the first error is the one to report
                with contextlib.suppress(CheckpointError):
                    ckpt.close()
            raise


def _task_evaluator(cfg: Config) -> TaskEvaluator | None:
    """train.eval_tasks' evaluator (evaluation/harness.py), its tasks read before compiling."""
    if not cfg.train.eval_tasks:
        return None
    mesh = build_mesh(cfg.mesh)
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = model_def(cfg)
    return task_evaluator(cfg, mdef, mesh, cfg.train.eval_tasks, shots=cfg.train.eval_shots)


def _train(
    trainer: Trainer,
    ckpt: TieredCheckpointer | None,
    train_batches,
    eval_streams,
    started: float,
    config_yaml: str,
    tasks: TaskEvaluator | None = None,
) -> dict:
    cfg, is_writer = trainer.cfg, jax.process_index() == 0
    start_step = _resume_or_load(trainer, ckpt, train_batches)
    if start_step >= cfg.train.steps:  # resumed from a local step at or past the end
        info = ckpt.restore_info or {}
        return _complete(cfg, start_step, info.get("dir") or f"the {info.get('tier')} tier")
    if ckpt is not None:
        ckpt.prewarm(trainer.saved_state())  # the first save's one-time costs, paid before the loop
    _start(trainer, ckpt, start_step, config_yaml, is_writer)
    profiler = Profiler(cfg)
    nonfinite = NonFiniteWatch(cfg.train, warn=functools.partial(warn, is_writer))
    with (
        metrics_lib.MetricsWriter(
            cfg.run_dir, is_writer=is_writer, start_step=start_step
        ) as writer,
        StopSignals(jax.process_count()) as signals,
    ):
        log = StepLog(cfg, writer, trainer, is_writer)
        evaluation = PeriodicEval(
            cfg,
            lambda: _evaluate_all(trainer, eval_streams, tasks, train_batches),
            writer,
            is_writer,
        )
        batch_metrics = getattr(train_batches, "batch_metrics", dict)
        next_batch = trainer.global_batch(next(train_batches))
        next_metrics = batch_metrics()
        compiling = _compile_progress(trainer, is_writer)  # the first step compiles
        for step in range(start_step + 1, cfg.train.steps + 1):
            profiler.before_step(step)
            with compiling if step == start_step + 1 else contextlib.nullcontext():
                trainer.state, step_metrics = trainer.step_fn(trainer.state, next_batch)
            step_metrics = {**step_metrics, **{f"rollout/{k}": v for k, v in next_metrics.items()}}
            nonfinite.after_step(step, step_metrics["finite"])  # reads the steps before it
            # Save before fetching the next batch: the saved data position must be step + 1.
            if ckpt is not None and step < cfg.train.steps and ckpt.due(step):
                _save(ckpt, trainer, train_batches, step, nonfinite, is_writer)
            stopping = signals.stop_after(step)  # no further batch: the position is saved
            if step < cfg.train.steps and not stopping:  # built while the step runs
                next_batch = log.fetch(lambda: trainer.global_batch(next(train_batches)))
                next_metrics = batch_metrics()
            profiler.after_step(step, trainer.state)
            log.after_step(step, step_metrics, stopping)
            if evaluation.due(step):
                evaluation.after_step(step)
                log.restart_clock()  # keep eval time out of step time
            if stopping:
                break
        nonfinite.settle(step)  # the last step's flag, before its state is saved
        _final_save(ckpt, trainer, train_batches, step, signals.signal_name, is_writer)
    summary = {
        **run_summary.basics(cfg, step),
        **{k: v for k, v in {**log.last, **evaluation.last}.items() if v is not None},
        "wall_time_s": time.perf_counter() - started,
    }
    if signals.signal_name:
        summary["stopped_by"] = signals.signal_name  # main's exit status
    if is_writer:
        path = run_summary.write(cfg.run_dir, summary)
        say(is_writer, run_summary.describe_end(summary, path))
    return summary


def _compile_progress(trainer: Trainer, is_writer: bool) -> contextlib.AbstractContextManager:
    """What the first step's compile says while it runs: minutes for a large model."""
    what = f"the train step of {trainer.cfg.model_name}"
    return compile_progress(what, devices_of(trainer.mesh), functools.partial(say, is_writer))


def _save(ckpt, trainer: Trainer, train_batches, step: int, nonfinite, is_writer: bool) -> None:
    """A step due in a tier, before the last (saved once, after the loop, by _final_save)."""
    nonfinite.settle(step)  # never save a non-finite step
    for tier in ckpt.maybe_save(step, trainer.saved_state(), train_batches):
        say(is_writer, f"checkpoint step {step}: {ckpt.dirs[tier] / str(step)}")


def _start(
    trainer: Trainer,
    ckpt: TieredCheckpointer | None,
    start_step: int,
    config_yaml: str,
    is_writer: bool,
) -> None:
    """The run directory's config.yml and the start-up lines: what trains where, and how."""
    cfg = trainer.cfg
    if is_writer:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "config.yml").write_text(config_yaml)
    resumed = f", resumed at step {start_step}" if start_step else ""
    devices = f"{trainer.mesh.size} devices ({jax.devices()[0].device_kind})"
    say(
        is_writer,
        f"maxtrain: {cfg.model_name}, {devices}, mesh {dict(trainer.mesh.shape)}, "
        f"run dir {cfg.run_dir}{resumed}",
    )
    # A warmup the schedule never ends is said in the start-up line (stdout), not as an error.
    warning = optim.warmup_warning(cfg.optim, cfg.schedule_steps)
    say(is_writer, run_summary.describe_start(cfg) + (f"; warning: {warning}" if warning else ""))
    if start_step and (note := _schedule_change(cfg, ckpt)):
        say(is_writer, note)


def _evaluate_all(
    trainer: Trainer,
    eval_streams: list[EvalStream],
    tasks: TaskEvaluator | None,
    train_batches: Any = None,
) -> dict[str, float]:
    """The held-out streams' losses, train.eval_tasks' scores where there are any, and an
    on-policy batch source's own held-out scores (OnPolicy)."""
    results = evaluate(trainer, eval_streams) if eval_streams else {}
    if tasks is not None:
        results.update(tasks(trainer.state.params))
    if callable(own := getattr(train_batches, "evaluate", None)):
        results.update(own())
    return results


def _schedule_change(cfg: Config, ckpt: TieredCheckpointer | None) -> str | None:
    """One line if the restored step was trained on a schedule of another length (train.steps
    raised with optim.schedule_steps unset re-stretches the decay), else None."""
    where = (ckpt.restore_info or {}).get("dir") if ckpt is not None else None
    if not where:
        return None
    try:
        saved = config_lib.validate_saved(
            yaml.safe_load(read_saved_config(where)) or {}, str(where)
        )
    except UserError:  # an older or unreadable saved config: nothing to compare
        return None
    if saved.schedule_steps == cfg.schedule_steps:
        return None
    return (
        f"maxtrain: note: the lr schedule now spans {cfg.schedule_steps} steps; step "
        f"{ckpt.restore_info['step']} was trained on one of "
        f"{saved.schedule_steps}, so the learning rate changes from here on (set "
        f"optim.schedule_steps={saved.schedule_steps} to keep that schedule)"
    )


def _final_save(
    ckpt: TieredCheckpointer | None,
    trainer: Trainer,
    train_batches,
    step: int,
    signal_name: str | None,
    is_writer: bool,
) -> None:
    """Stopped by a signal: the step goes to the fast tier, durable before the exit. Else the
    final state goes to the persistent tier, so a restart finds the run complete."""
    stopped_by = {"SIGTERM": "SIGTERM", "SIGINT": "interrupted (SIGINT)"}.get(signal_name)
    if ckpt is None:
        if stopped_by:
            say(is_writer, f"maxtrain: {stopped_by}: checkpointing is off; nothing saved")
        return
    if stopped_by:
        ckpt.save_now(step, trainer.saved_state(), train_batches, tier="local", wait=True)
        say(is_writer, f"maxtrain: {stopped_by}: saved step {step} to the local tier; exiting")
    else:
        ckpt.save_now(step, trainer.saved_state(), train_batches, tier="persistent", wait=True)
        say(is_writer, f"checkpoint step {step}: {ckpt.dirs['persistent'] / str(step)} (final)")
    ckpt.close()


FLAGS = ("--debug", "--print-config", "--list-models", "-h", "--help")


def main(
    argv: list[str] | None = None,
    preflight: Callable[[Config], None] | None = None,
    on_policy: OnPolicy | None = None,
) -> int:
    """`python -m maxtrain.train`: flags (FLAGS, anywhere), then the config file and its
    key=value overrides. preflight, on_policy: passed on to run (the entry point's memory
    check and on-policy batches)."""
    argv = sys.argv[1:] if argv is None else argv
    # Orbax builds the coroutines of an asynchronous save before it runs them; a run refused
    # at once (a start checkpoint of another model) drops them unrun, and Python warns of each
    # as it is collected, after the one line that says what was wrong. Nothing is lost: the
    # refusal comes before the run trains a step.
    warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
    flags = {a for a in argv if a.startswith("-")}
    argv = path_first([a for a in argv if not a.startswith("-")])
    if "--debug" in flags:  # tracebacks for refused inputs, as MAXTRAIN_DEBUG=1
        os.environ[DEBUG_ENV] = "1"
    if flags & {"-h", "--help"}:
        print(discovery.help_text())
        return 0
    try:
        if unknown := sorted(flags - set(FLAGS)):
            raise UserError(f"unknown option {unknown[0]}; options: {', '.join(FLAGS)}")
        if "--list-models" in flags:
            print(discovery.models_table())
            return 0
        if not argv or ("=" in argv[0] and not os.path.exists(argv[0])):  # overrides only
            raise UserError(f"no config file given; usage: {discovery.USAGE}")
        cfg = config_lib.load(argv[0], argv[1:])
        if "--print-config" in flags:
            print(config_lib.to_yaml(cfg), end="")
            return 0
        summary = run(cfg, preflight, on_policy)
    except UserError as e:  # config, data, checkpoint, a busy run dir: the user's to fix
        return refuse("maxtrain", e)
    except NonFiniteLoss as e:
        print(f"maxtrain: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the train loop, which turns SIGINT into a saved stop
        print(
            "maxtrain: interrupted (SIGINT) outside the train loop; nothing more was saved",
            file=sys.stderr,
        )
        return EXIT_STATUS["SIGINT"]
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        _lost_peer(e)
    return EXIT_STATUS.get(summary.get("stopped_by"), 0)


def _lost_peer(error: Exception) -> None:
    """A collective failed in a multi-process run: almost always another process died. Says so
    in one line and exits at once: jax's own shutdown would wait on the dead process's barrier,
    then abort with a C++ stack trace."""
    print(
        f"maxtrain: error: process {jax.process_index()} lost contact with the other processes "
        f"({first_line(error, 300)}); restart all of them to resume from the last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
