"""What a user sees between the documented workflows: the start-up, checkpoint and end lines,
summary.json, extending a finished run (its schedule), and a run killed before its summary.

One tiny run in this process, extended once with its schedule pinned (the same program: the
compilation cache serves it), then started again once complete."""

from __future__ import annotations

import json
import re
import types

import pytest

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain import optim
from maxtrain.training import loop as train_lib
from maxtrain.training import run_lock
from maxtrain.training.loop import run

BASE = config_lib.CONFIGS_DIR / "base.yml"

RUN = ("train.log_every=1", "checkpoint.local.every_steps=2", "optim.lr=1e-2")


def lrs(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["train/lr"] for r in map(json.loads, lines) if "train/lr" in r}


def test_a_run_says_what_it_trains_saves_and_did_and_an_extension_keeps_or_names_its_schedule(
    make_cfg, capsys
):
    cfg = make_cfg(*RUN, "train.eval_every=4")
    summary = run(cfg)
    out = capsys.readouterr().out
    total, active = model_lib.param_count(cfg.model), model_lib.active_param_count(cfg.model)
    # Start-up: parameters (total, active), steps, the schedule's length.
    assert f"parameters ({active / 1e3:.3g}K active per token)" in out and total == active
    assert "lr schedule cosine over 4 steps" in out
    # What the start-up waited for is said: the data, then the first step's compile (compiled,
    # or loaded from the compilation cache) before its line (compile_progress: test_cli).
    compiled = re.search(r"the train step of tiny for 8 cpu devices: (compiled|loaded from)", out)
    assert compiled and out.index("preparing") < compiled.start() < out.index("| loss"), out
    # A line per checkpoint, naming the step and its directory; the final one too.
    local, persistent = (
        cfg.run_dir / "checkpoints" / "local",
        cfg.run_dir / "checkpoints" / "persistent",
    )
    assert f"checkpoint step 2: {local / '2'}\n" in out
    assert f"checkpoint step 4: {persistent / '4'} (final)\n" in out
    # The last step, due in the local tier too, is saved once (docs/checkpoints.md).
    assert out.count("checkpoint step 4:") == 1 and not (local / "4").exists()
    # summary.json: metrics.jsonl's keys, the run's totals, and a last line pointing at it.
    on_disk = json.loads((cfg.run_dir / "summary.json").read_text())
    assert on_disk == pytest.approx(summary)
    last_eval = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in last_eval if "eval/loss" in r][-1]
    assert on_disk["eval/loss"] == last_eval["eval/loss"] and "eval_loss" not in on_disk
    assert on_disk["step"] == 4 and on_disk["tokens_seen"] == 4 * 8 * 32
    assert (on_disk["params_total"], on_disk["params_active"]) == (total, active)
    assert on_disk["wall_time_s"] > 0 and on_disk["train/loss"] > 0
    assert out.rstrip().endswith(f"summary in {cfg.run_dir / 'summary.json'}")
    assert "maxtrain: done at step 4 in " in out

    # Extended with the schedule's length pinned to the old one: no note, and past its end
    # the lr stays at its floor (a cosine over 4 steps, then lr * min_lr_ratio).
    run(make_cfg(*RUN, "train.steps=6", "optim.schedule_steps=4"))
    out = capsys.readouterr().out
    assert "lr schedule now spans" not in out and "resumed at step 4" in out
    lr = lrs(cfg.run_dir)
    assert lr[5] == lr[6] == pytest.approx(1e-2 * cfg.optim.min_lr_ratio)
    assert lr[2] > lr[3] > lr[4] > lr[5]
    # Extended by raising train.steps alone, the decay would re-stretch over 8 steps: the
    # resume says so in one line naming how to keep the old schedule (read from the config
    # saved with the step it resumes from).
    longer = make_cfg(*RUN, "train.steps=8")
    step_6 = cfg.run_dir / "checkpoints" / "persistent" / "6"
    restored = types.SimpleNamespace(restore_info={"dir": str(step_6), "step": 6})
    assert train_lib._schedule_change(longer, restored) == (
        "maxtrain: note: the lr schedule now spans 8 steps; step 6 was trained on one of 4, so "
        "the learning rate changes from here on (set optim.schedule_steps=4 to keep that "
        "schedule)"
    )
    pinned = make_cfg(*RUN, "train.steps=8", "optim.schedule_steps=4")
    assert train_lib._schedule_change(pinned, restored) is None

    # Killed after its final save, before summary.json, with its lock left filled in: the
    # next start finds it complete, writes the summary from metrics.jsonl and frees the lock.
    (cfg.run_dir / "summary.json").unlink()
    left = {"pid": 99999999, "host": "gone", "started": "2025-01-01T00:00:00"}
    (cfg.run_dir / run_lock.LOCK).write_text(json.dumps(left))
    assert run(make_cfg(*RUN, "train.steps=6", "optim.schedule_steps=4"))["step"] == 6
    out, err = capsys.readouterr()
    assert "is complete: step 6" in out and "wrote the missing" in out
    assert "taking over" in err and "pid 99999999 on gone" in err
    assert (cfg.run_dir / run_lock.LOCK).read_text() == ""
    written = json.loads((cfg.run_dir / "summary.json").read_text())
    assert written["step"] == 6 and written["train/lr"] == lr[6]
    assert written["tokens_seen"] == 6 * 8 * 32 and "wall_time_s" not in written


def test_warmup_as_long_as_the_schedule_is_warned(make_cfg):
    """train.steps=20 with optim.warmup_steps=30 ends mid-warmup: said at start-up. Not for
    the default warmup (a short smoke test's), nor at lr 0."""
    for quiet in (["model_name=tiny", "train.steps=20"], ["train.steps=1", "optim.lr=0"]):
        short = config_lib.load(BASE, quiet + ["optim.warmup_steps=30"] * ("optim.lr=0" in quiet))
        assert optim.warmup_warning(short.optim, short.schedule_steps) is None
    cfg = make_cfg("train.steps=20", "optim.warmup_steps=30")
    assert optim.warmup_warning(cfg.optim, cfg.schedule_steps) == (
        "optim.warmup_steps=30 is not shorter than the schedule (20 steps): the learning rate "
        "never decays; lower optim.warmup_steps"
    )
    longer = make_cfg("train.steps=20", "optim.warmup_steps=30", "optim.schedule_steps=300")
    assert optim.warmup_warning(longer.optim, longer.schedule_steps) is None
    constant = make_cfg("train.steps=20", "optim.warmup_steps=30", "optim.schedule=constant")
    assert optim.warmup_warning(constant.optim, constant.schedule_steps) is None


def test_a_run_with_checkpoints_refuses_another_model_data_or_objective(tmp_path, capsys):
    """A finished run compared with the config it finished with: another model or data is
    refused (exit 2) naming the keys, old -> new, and run.name; the same config, or one that
    changes only the cadence, is complete as before. An unfinished run (train.steps raised)
    is refused the same way before it resumes."""
    tiny = (
        str(BASE), "model_name=tiny", "data.kind=synthetic", f"run.output_dir={tmp_path}",
        "train.steps=2", "train.global_batch_size=8", "train.seq_len=32",
        "train.eval_every=0", "optim.warmup_steps=1",
    )  # fmt: skip
    assert train_lib.main([*tiny]) == 0
    capsys.readouterr()

    assert train_lib.main([*tiny, "model_name=tiny-qk"]) == 2
    err = capsys.readouterr().err
    assert "model_name: 'tiny' -> 'tiny-qk'" in err and "model.qk_norm: 'none' -> 'rms'" in err
    assert "another run.name" in err and err.count("\n") == 1
    assert train_lib.main([*tiny, "data.synthetic_branching=8"]) == 2
    assert "data.synthetic_branching: 4 -> 8" in capsys.readouterr().err
    assert train_lib.main([*tiny, "train.steps=4", "model_name=tiny-qk"]) == 2  # a resume
    assert "model_name: 'tiny' -> 'tiny-qk'" in capsys.readouterr().err

    for same in ([], ["train.log_every=1", "compute.remat=none"]):
        assert train_lib.main([*tiny, *same]) == 0
        assert f"run {tmp_path / 'default'} is complete: step 2" in capsys.readouterr().out
