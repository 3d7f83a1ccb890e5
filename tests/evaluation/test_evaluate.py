"""Evaluation: the train loop's eval and `python -m maxtrain.evaluate` give the same numbers for
the same checkpoint, and task files are checked like every other input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from maxtrain import evaluate as evaluate_cli
from maxtrain.common.errors import UserError
from maxtrain.evaluation.tasks import COMMITTED, load_task
from maxtrain.training import loop as train

TASK = COMMITTED / "code_next_line" / "test.jsonl"


def test_in_training_eval_equals_the_standalone_tool(make_cfg, tmp_path, capsys):
    """Two steps of the default model on the embedded corpus with a task scored 1-shot at the
    final eval; the tool on the saved checkpoint prints the same accuracies, log-likelihood
    based, and the same held-out loss."""
    task = tmp_path / "task.jsonl"
    task.write_text("".join(TASK.read_text().splitlines(keepends=True)[:12]))
    cfg = make_cfg(
        "model_name=small",
        "data.kind=grain",
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_steps=1",
        f"train.eval_tasks=[{task}]",
        "train.eval_shots=1",
    )
    train.run(cfg)
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    in_training = next(line for line in lines if "eval/task/acc" in line)
    out = tmp_path / "results.json"
    args = [str(cfg.run_dir), "--tasks", str(task), "--shots", "1", "--loss", "--output", str(out)]
    assert evaluate_cli.main(args) == 0
    standalone = json.loads(out.read_text())
    assert standalone["step"] == 2
    for key in ("task/acc", "task/acc_norm"):
        assert standalone[key] == in_training[f"eval/{key}"], key
    assert math.isclose(standalone["loss"], in_training["eval/loss"], rel_tol=1e-6)
    assert "task/acc" in capsys.readouterr().out
    # A run trained without evaluation (train.eval_every=0) still has its held-out documents.
    quiet = [str(cfg.run_dir), "train.eval_every=0", "--no-tasks", "--loss", "--output", str(out)]
    assert evaluate_cli.main(quiet) == 0
    assert json.loads(out.read_text())["loss"] == standalone["loss"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{bad", "task.jsonl:2: not JSON"),
        ('{"context": "a", "choices": ["x"], "gold": 0}', "at least 2 non-empty strings"),
        ('{"context": "a", "choices": ["x", "y"], "gold": 2}', '"gold" must be an index'),
        ('{"context": "a"}', 'or a "continuation" string'),
    ],
)
def test_bad_task_lines_are_named(tmp_path, line, message):
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "a", "choices": ["x", "y"], "gold": 0}\n' + line + "\n")
    with pytest.raises(UserError, match=message):
        load_task(str(task))


def test_shots_are_seeded_and_never_the_example_itself():
    task = load_task("prose_continuation")
    first, again, other = task.prompts(2, 0), task.prompts(2, 0), task.prompts(2, 1)
    assert first == again and first != other
    for prompt, example in zip(first, task.test, strict=True):
        shots = prompt.removesuffix(example.context).split("\n\n")[:-1]
        assert len(shots) == 2
        assert example.context + example.choices[example.gold] not in shots
    with pytest.raises(UserError, match="unknown task 'nope'; committed tasks: arithmetic"):
        load_task("nope")
    assert Path(COMMITTED / "prose_continuation" / "train.jsonl").is_file()


def test_a_bad_task_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    assert evaluate_cli.main([str(tmp_path / "no-run"), "--tasks", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task 'nope'" in err
