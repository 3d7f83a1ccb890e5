"""The idle share read from the compiled train step (analysis/bubble.py), against the tables'
formulas: 4 stages, M = 2S = 8 micro-batches of the tiny model, 8 simulated CPU devices,
compiled from shapes only (nothing runs)."""

import pytest

from maxtrain import config as config_lib
from maxtrain.analysis import bubble
from maxtrain.benchmarks.compiled_step import pipeline_idle_share
from maxtrain.parallel.schedules import BACKWARD, FORWARD, WEIGHT
from maxtrain.training import run_model
from maxtrain.training.trainer import build_trainer, compile_step

S, M = 4, 8


@pytest.fixture(scope="module")
def readings(tmp_path_factory) -> dict:
    """Each in-schedule table's reading, formula value (every pass alike) and what
    `tools/benchmark.py --dry-run --compile` prints of it."""
    out = tmp_path_factory.mktemp("bubble")
    found = {}
    for schedule in ("1f1b", "zero_bubble"):
        overrides = [
            "model_name=tiny", "model.num_layers=8", "data.kind=synthetic",
            "train.global_batch_size=16", "train.seq_len=32", "checkpoint.enabled=false",
            f"mesh.stage={S}", "mesh.fsdp=2", f"pipeline.schedule={schedule}",
            f"pipeline.microbatches={M}", f"run.output_dir={out}",
        ]  # fmt: skip
        cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
        trainer = build_trainer(cfg, abstract=True)
        compiled, _, _ = compile_step(trainer)
        layout = run_model.stage_layout(trainer.cfg)
        hlo = compiled.as_text()
        printed = pipeline_idle_share(trainer, hlo)["pipeline_idle_share"]
        found[schedule] = (bubble.read(hlo, layout.table), layout.bubble, printed)
    return found


def test_zero_bubble_idles_less_than_1f1b_at_M_2S(readings):
    """1F1B's share does not depend on how a unit's work splits between its slots: the
    formula's (S - 1) / (M + S - 1). Zero bubble's does, and the program's backward costs
    more than twice its forward here (the attention's), so it idles more than the formula's
    2 (S - 1) / (3 M + 2 (S - 1)) but less than 1F1B."""
    one_f_one_b, formula, _ = readings["1f1b"]
    assert one_f_one_b.idle_share == pytest.approx(formula) == (S - 1) / (M + S - 1)
    zero_bubble, zb_formula, _ = readings["zero_bubble"]
    assert zb_formula < zero_bubble.idle_share < one_f_one_b.idle_share


def test_the_dry_run_prints_the_compiled_idle_share_beside_the_formula(readings):
    """`compiled.pipeline_idle_share` of the benchmark's dry run: 1F1B's read equals its
    formula, (S - 1) / (M + S - 1) = 3/11; zero bubble's read is below it and above its own
    formula, 2 (S - 1) / (3 M + 2 (S - 1)) = 1/5."""
    one_f_one_b, zero_bubble = readings["1f1b"][2], readings["zero_bubble"][2]
    assert one_f_one_b == {"schedule": "1f1b", "formula": 0.2727, "compiled": 0.2727}
    assert zero_bubble["schedule"] == "zero_bubble" and zero_bubble["formula"] == 0.2
    assert 0.2 < zero_bubble["compiled"] < 0.2727


def test_the_split_backward_does_the_whole_backward_work_once(readings):
    """Zero bubble's input and weight gradients together are 1F1B's backward, matmul FLOP for
    matmul FLOP, and the forward is the same: no pass is recomputed or lost by the split."""
    whole, split = readings["1f1b"][0].work, readings["zero_bubble"][0].work
    assert split[FORWARD] == pytest.approx(whole[FORWARD], rel=1e-9)
    assert split[BACKWARD] + split[WEIGHT] == pytest.approx(whole[BACKWARD], rel=1e-9)
    assert split[WEIGHT] > 0
