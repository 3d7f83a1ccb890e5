"""The command line: a run end to end in a subprocess, as a user runs it; refusals and the
discovery options through the command's main, in this process."""

import json
import os
import subprocess
import sys

import jax
from support.xla_env import xla_flags

from maxtrain.analysis.preflight import check_memory
from maxtrain.common.errors import DEBUG_ENV
from maxtrain.config import CONFIGS_DIR, REPO_ROOT
from maxtrain.training import loop as train_loop


def run_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "maxtrain.train",
            str(CONFIGS_DIR / "base.yml"),
            "data.kind=synthetic",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )


def test_cli_trains_and_writes_metrics_config_and_tensorboard(tmp_path):
    result = run_cli(
        "model_name=tiny",
        "train.steps=6",
        "train.log_every=3",
        "train.eval_every=6",
        "train.seq_len=32",
        "train.global_batch_size=4",
        "run.name=cli",
        f"run.output_dir={tmp_path}",
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "cli"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in train_lines] == [3, 6]
    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/step_time_s",
        "train/tokens_per_sec_per_device",
        "train/tflops_per_device",
    ):
        assert key in train_lines[-1], key
    assert "train/mfu" not in train_lines[-1]  # CPU has no peak: MFU is not invented
    assert any("eval/loss" in x for x in lines)
    assert "model_name: tiny" in (run_dir / "config.yml").read_text()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "step     6/6" in result.stdout


def main_in_process(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """The train command's main as the entry point calls it (with its memory pre-flight), in
    this process: (exit status, stdout, stderr). A refusal costs no interpreter start; that its
    exit status and a stderr free of tracebacks survive the interpreter's boundary is shown in
    tests/training/test_bad_inputs.py."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    capsys.readouterr()
    argv = [str(CONFIGS_DIR / "base.yml"), "data.kind=synthetic", *args]
    status = train_loop.main(argv, preflight=check_memory)
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_bad_key_exits_2_with_one_line_naming_it(tmp_path, capsys, monkeypatch):
    status, _, err = main_in_process(
        capsys, monkeypatch, "model_name=tiny", "optim.learning_rate=1e-3",
        f"run.output_dir={tmp_path}",
    )  # fmt: skip
    assert status == 2
    assert err.strip().count("\n") == 0, err
    assert "optim.learning_rate" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing written for a rejected config


def test_cli_mesh_that_does_not_fit_the_devices_exits_2(tmp_path, capsys, monkeypatch):
    devices = len(jax.devices())
    status, _, err = main_in_process(
        capsys, monkeypatch, "model_name=tiny", f"mesh.fsdp={2 * devices}",
        f"run.output_dir={tmp_path}",
    )  # fmt: skip
    assert status == 2
    assert "mesh" in err and f"{devices} are available" in err
    assert "Traceback" not in err


def test_cli_data_mistakes_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    status, _, missing = main_in_process(
        capsys, monkeypatch, "model_name=small", "data.kind=grain",
        "data.sources=[{name: web, path: /nonexistent/*.arrayrecord, weight: 1}]",
        f"run.output_dir={tmp_path}",
    )  # fmt: skip
    assert status == 2, missing
    assert "/nonexistent/*.arrayrecord" in missing
    assert missing.strip().count("\n") == 0 and "Traceback" not in missing
    status, _, small_vocab = main_in_process(
        capsys, monkeypatch, "model_name=tiny", "data.kind=grain", f"run.output_dir={tmp_path}"
    )
    assert status == 2, small_vocab
    assert "vocab" in small_vocab and "256" in small_vocab
    assert not any(tmp_path.iterdir())


def test_cli_refuses_a_model_beyond_the_hosts_memory_before_writing_anything(
    tmp_path, capsys, monkeypatch
):
    """deepseek-v3-671b needs terabytes per device on the CPU devices, beyond any host's RAM:
    refused in one line naming the estimate, the RAM and the override, before the run
    directory, its lock or its checkpoint folders exist (it used to die in XLA's
    RESOURCE_EXHAUSTED inside the checkpointer, leaving them behind)."""
    status, _, err = main_in_process(
        capsys, monkeypatch, "model_name=deepseek-v3-671b", "run.name=big", "train.steps=2",
        f"run.output_dir={tmp_path}",
    )  # fmt: skip
    assert status == 2, err
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "GiB of RAM" in err and "run.check_memory=false" in err
    assert not any(tmp_path.iterdir())


def discover(capsys, *args: str) -> tuple[int, str, str]:
    """The train command's discovery options, in this process (they import nothing heavy and
    run nothing): (exit status, stdout, stderr)."""
    status = train_loop.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_help_lists_every_config_section_with_its_docstring(capsys):
    from maxtrain.config import Config

    status, out, err = discover(capsys, "--help")
    assert status == 0, err
    assert out.startswith("usage: python -m maxtrain.train")
    for flag in ("--print-config", "--list-models"):
        assert f"  {flag}" in out
    listed = {line.split()[0] for line in out.split("config sections:\n")[1].splitlines()}
    assert listed == set(Config.model_fields)
    # Each section's line holds its docstring's opening words.
    assert "checkpoint      Checkpoints in two tiers" in out
    assert "lora            Low-rank adapters on a frozen base model" in out


def test_list_models_lists_every_preset_with_its_size(capsys):
    from maxtrain import config as config_lib

    status, out, err = discover(capsys, "--list-models")
    assert status == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert sorted(rows) == config_lib.preset_names()
    # configs/models/tiny.yml says 106,816 parameters; llama3-8b is 8.03B (Meta's model card),
    # and mixtral-8x7b is 46.7B with 12.9B active (Mistral's announcement).
    assert rows["tiny"] == ["107K", "107K", "2", "64"]
    assert rows["llama3-8b"] == ["8.03B", "8.03B", "32", "4096"]
    assert rows["mixtral-8x7b"][:2] == ["46.7B", "12.9B"]
    assert rows["gemma3-1b"][0] == "1B"  # 999,885,952: rounded before its unit (was 1e+03M)


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys, monkeypatch):
    import yaml

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    base = str(CONFIGS_DIR / "base.yml")
    args = ["train.steps=7", "model_name=tiny", f"run.output_dir={tmp_path}"]
    status, out, err = discover(capsys, "--print-config", base, *args)
    assert status == 0, err
    printed = yaml.safe_load(out)
    assert printed["train"]["steps"] == 7 and printed["model"]["num_layers"] == 2
    assert printed["optim"]["lr"] == 3e-3  # a default the command line did not set
    assert not any(tmp_path.iterdir())
    status, out, err = discover(capsys, "--print-config", base, "train.stepz=7")
    assert status == 2 and "'train.stepz'; did you mean 'train.steps'" in err
    assert out == ""
