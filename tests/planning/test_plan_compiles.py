"""The planner end to end on compile-only TPU devices (v5e:2x2) and the winner's overlay run
on CPU: a plan of the tiny model prints its table and writes an overlay, a second plan comes
from the cache without compiling; a reduced-depth proxy's verdict scaled to the model's depth
matches the full depth compiled; and the overlay trains exactly as the same layout written by
hand."""

import json
import subprocess
import sys

import pytest
import yaml
from support import runs
from support.xla_env import xla_flags

from maxtrain import config as config_lib
from maxtrain.common import devices
from maxtrain.planning import report, worker
from maxtrain.planning.candidates import Candidate
from maxtrain.planning.screening import Screened

BASE = str(config_lib.CONFIGS_DIR / "base.yml")
TINY = ["model_name=tiny", "model.num_layers=4", "train.global_batch_size=8", "train.seq_len=128"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A plan of the tiny model's own layout only (--compiles 0), as two proxy depths, run
    twice into one cache: (the first summary, the second, the overlay's path)."""
    where = tmp_path_factory.mktemp("plan")
    overlay = where / "plan.yml"
    command = [BASE, *TINY, "--topology", "v5e:2x2", "--compiles", "0", "--proxy"]
    command += ["--out", str(overlay)]
    env = {**runs.env(), "MAXTRAIN_CACHE": str(where / "cache")}
    summaries = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "tools/plan.py", *command],
            capture_output=True,
            text=True,
            env=env,
            cwd=config_lib.REPO_ROOT,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        summaries.append(json.loads(done.stdout.splitlines()[-1]))
    return *summaries, overlay


def test_a_plan_writes_the_winner_and_a_second_comes_from_the_cache(planned):
    first, second, overlay = planned
    assert first["compiled"] == 1 and first["from_cache"] == 0
    assert first["winner"]["fits"] and first["winner"] == first["config"]
    assert first["candidates"] > first["screened_in"] > 0 and first["ruled_out"]
    assert second["from_cache"] == 1 and second["winner"]["verdict"].endswith("(cache)")
    assert {**second["winner"], "verdict": None} == {**first["winner"], "verdict": None}
    written = yaml.safe_load(overlay.read_text())
    cfg = config_lib.load(BASE, [*TINY, str(overlay)])
    assert cfg.mesh.fsdp == written["mesh"]["fsdp"] == 4
    assert cfg.compute.remat == written["compute"]["remat"]


def test_the_proxy_scaled_to_the_depth_matches_the_full_compile(planned):
    """The plan compiled depths 1 and 2 and scaled them to 4 layers; the 4-layer model
    compiled whole predicts the same step within 5%, and the same peak memory within the
    compiled figure's rounding (a thousandth of a GiB: the tiny model needs 7 MiB)."""
    first, _, _ = planned
    scaled = first["winner"]
    request = {"config": BASE, "overrides": [*TINY, "mesh.fsdp=4"], "topology": "v5e:2x2"}
    full = worker.verdict(request)
    assert scaled["step_s"] == pytest.approx(full["step_s"], rel=0.05)
    assert scaled["peak_gib"] == pytest.approx(full["peak_gib"], abs=0.0015)


def test_the_winners_overlay_trains_as_the_layout_written_by_hand(tmp_path):
    """A winner's overlay (written as the plan writes it) on 8 simulated CPU devices: the run's
    losses are bit for bit those of a config file that states the same layout by hand."""
    layout = Candidate((2, 1, 2, 1, 2, 1), (1,) * 6, "minimal", 2)
    winner = report.Outcome(Screened(layout, 0.01, 0.0), False, True, 1e-4, 0.01, "memory", 0.1)
    overlay = tmp_path / "plan.yml"
    report.write_overlay(str(overlay), winner, "python tools/plan.py ...", devices.chip("tpu v5e"))
    by_hand = tmp_path / "by_hand.yml"
    by_hand.write_text(
        f"base_config: {BASE}\n"
        "mesh: {data: 2, fsdp: 2, tensor: 2}\n"
        "compute: {remat: minimal}\n"
        "train: {grad_accum_steps: 2}\n"
    )
    args = [*runs.ARGS[:5], "train.steps=3", "train.log_every=1", "train.seq_len=64"]
    args += ["train.global_batch_size=8"]  # micro-batches of 4: one row per data x fsdp
    losses = []
    for name, config in (("overlay", [BASE, str(overlay)]), ("by_hand", [str(by_hand)])):
        run_dir = tmp_path / name
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "maxtrain.train",
                *config,
                *args,
                f"run.output_dir={tmp_path}",
                f"run.name={name}",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            env={**runs.env(), "XLA_FLAGS": xla_flags(8)},
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        losses.append(runs.losses(run_dir))
    assert len(losses[0]) == 3 and losses[0] == losses[1]
