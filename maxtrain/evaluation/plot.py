"""One PNG comparing runs: loss (train and eval), learning rate, throughput and MFU.

    python tools/plot_metrics.py runs/a runs/b --output compare.png [--x tokens]

Each argument is a run directory (its metrics.jsonl and config.yml, as maxtrain.train writes
them). The panels share the x axis, steps or tokens seen (steps x train.global_batch_size x
train.seq_len, so runs of different batch shapes line up by data); eval loss is drawn dashed
over the training loss (each quantity of a panel has its own line style, each run its own
colour), task accuracies (train.eval_tasks) get a panel when a run has them, as do a GRPO
run's reward and held-out accuracy,
and MFU one when the device's peak is known (else TFLOP/s per device). Needs matplotlib
(`pip install -e '.[plot]'`). A missing or unreadable run is one line and exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from maxtrain.common.errors import ArgumentParser, UserError, refuse

PROG = "plot_metrics"
DPI = 64  # small files: a README image
STYLES = ["-", "--", ":", "-."]  # a panel's quantities; a run keeps its colour throughout


def read_run(run_dir: Path) -> tuple[list[dict], int]:
    """(metrics.jsonl's records, tokens per step) of a run directory."""
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.yml"
    if not metrics.is_file() or not config.is_file():
        raise UserError(f"{run_dir} is not a run directory: it needs metrics.jsonl and config.yml")
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        train = yaml.safe_load(config.read_text())["train"]
        tokens_per_step = int(train["global_batch_size"]) * int(train["seq_len"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise UserError(f"cannot read {run_dir}: {e}") from None
    if not records:
        raise UserError(f"{metrics} holds no records")
    return records, tokens_per_step


def series(records: list[dict], key: str, scale: int) -> tuple[list[float], list[float]]:
    points = [(r["step"] * scale, r[key]) for r in records if key in r]
    return [x for x, _ in points], [y for _, y in points]


def plot(run_dirs: list[Path], output: Path, x_axis: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise UserError("matplotlib is not installed: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = {_label(d, run_dirs): read_run(d) for d in run_dirs}
    keys = {k for records, _ in runs.values() for r in records for k in r}
    tasks = sorted(k for k in keys if k.startswith("eval/") and k.endswith("/acc"))
    speed = "train/mfu" if "train/mfu" in keys else "train/tflops_per_device"
    panels = [
        ("loss", ["train/loss", "eval/loss"]),
        ("learning rate", ["train/lr"]),
        ("tokens/s/device", ["train/tokens_per_sec_per_device"]),
        ("MFU" if speed == "train/mfu" else "TFLOP/s/device", [speed]),
    ]
    if tasks:
        panels.append(("task accuracy", tasks))
    if "train/rollout/reward" in keys:  # GRPO (docs/rl.md): its reward and held-out accuracy
        panels.append(("reward, accuracy", ["train/rollout/reward", "eval/accuracy"]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, (records, tokens_per_step)), color in zip(runs.items(), colors * 10, strict=False):
        scale = tokens_per_step if x_axis == "tokens" else 1
        for ax, (title, panel_keys) in zip(axes, panels, strict=True):
            for key, style in zip(panel_keys, STYLES * len(panel_keys), strict=False):
                xs, ys = series(records, key, scale)
                if xs:
                    name = label if len(panel_keys) == 1 else f"{label} {key}"
                    ax.plot(
                        xs, ys, style, color=color, label=name, marker="." if len(xs) < 10 else None
                    )
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("tokens" if x_axis == "tokens" else "step")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=DPI)
    plt.close(fig)


def _label(run_dir: Path, all_dirs: list[Path]) -> str:
    """The run's directory name, with its parent's when two runs share a name."""
    same = [d for d in all_dirs if d.name == run_dir.name]
    return run_dir.name if len(same) == 1 else f"{run_dir.parent.name}/{run_dir.name}"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--x", choices=("steps", "tokens"), default="steps", dest="x_axis")
    args = parser.parse_args(argv)
    try:
        plot(args.runs, args.output, args.x_axis)
    except UserError as e:
        return refuse(PROG, e)
    print(f"{PROG}: wrote {args.output}")
    return 0
