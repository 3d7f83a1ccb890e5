"""tools/plot_metrics.py: two runs -> one PNG with a panel per quantity; a bad run
directory
is one line, exit 2, and no file."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import yaml

from maxtrain.evaluation import plot


def write_run(run_dir: Path, loss0: float, with_tasks: bool) -> None:
    """A run directory as maxtrain.train writes it: metrics.jsonl records and config.yml."""
    run_dir.mkdir(parents=True)
    records = []
    for step in range(10, 110, 10):
        train = {"train/loss": loss0 / step**0.1, "train/lr": 1e-3, "train/tflops_per_device": 0.1}
        records.append({"step": step, **train, "train/tokens_per_sec_per_device": 900.0})
        if step % 50 == 0:
            tasks = {"eval/prose/acc": step / 200} if with_tasks else {}
            records.append({"step": step, "eval/loss": loss0 / step**0.1 + 0.1, **tasks})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"train": {"global_batch_size": 16, "seq_len": 128}}
    (run_dir / "config.yml").write_text(yaml.safe_dump(config))


def test_two_runs_make_one_png_with_a_panel_each(tmp_path, capsys):
    tool = plot
    write_run(tmp_path / "a", 7.0, with_tasks=True)
    write_run(tmp_path / "b", 6.0, with_tasks=False)
    out = tmp_path / "cmp.png"
    args = [str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(out), "--x", "tokens"]
    assert tool.main(args) == 0
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (
        8 * tool.DPI,
        round(2.4 * 5 * tool.DPI),
    )  # loss, lr, tokens/s, TFLOP/s, tasks

    assert tool.main([str(tmp_path / "nope"), "--output", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope is not a run directory" in err
    assert not (tmp_path / "x.png").exists()
