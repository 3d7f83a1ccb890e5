"""What makes a run the run it is (maxtrain/training/run_identity.py), compared key by key."""

import os

import numpy as np
import pytest
from support.runs import losses, stopped_at

from maxtrain import config as config_lib
from maxtrain.training.loop import run
from maxtrain.training.run_identity import ChangedRun, differences

SFT = config_lib.CONFIGS_DIR / "sft.yml"


def test_a_relative_data_path_saved_before_paths_resolved_beside_the_config_is_the_same_run(
    monkeypatch,
):
    """configs/sft.yml's data path now loads absolute (beside the file); a run started from the
    repository before that saved it relative to its working directory. Compared from there, the
    two name the same file: no difference. Another file is one."""
    monkeypatch.chdir(config_lib.REPO_ROOT)
    now = config_lib.load(SFT)
    path = now.data.sources[0].path
    assert os.path.isabs(path)
    relative = os.path.relpath(path)
    saved = config_lib.load(SFT, [f"data.sources=[{{name: chat, path: {relative}, format: chat}}]"])
    assert saved.data.sources[0].path == relative
    assert differences(saved, now) == []
    other = config_lib.load(SFT, ["data.sources=[{name: chat, path: other.jsonl, format: chat}]"])
    assert [key for key, _, _ in differences(other, now)] == ["data.sources[0].path"]


def test_compute_is_no_part_of_the_run_but_the_model_is(make_cfg):
    """How the model is computed (compute:) may change between the slices of a run; what it
    is (model:), where it starts from (init:) may not."""
    run = make_cfg("model_name=tiny-moe")
    computed_otherwise = make_cfg(
        "model_name=tiny-moe", "compute.expert_exchange=all_gather", "compute.grouped_matmul=xla",
        "compute.remat=none", "compute.param_dtype=bfloat16", "compute.attention=xla",
    )  # fmt: skip
    assert differences(run, computed_otherwise) == []
    other = make_cfg("model_name=tiny-moe", "model.emb_dim=32", "init.std=0.01")
    assert [key for key, _, _ in differences(run, other)] == ["model.emb_dim", "init.std"]


# tiny-moe's experts over 2 devices, 4 steps on one schedule whatever train.steps says.
MOE_ON_TWO = (
    "model_name=tiny-moe", "mesh.expert=2", "mesh.fsdp=4", "optim.schedule_steps=4",
    "checkpoint.local.every_steps=2", "train.log_every=1", "compute.expert_exchange=all_to_all",
)  # fmt: skip


@pytest.mark.slow
def test_a_resume_with_another_exchange_and_kernel_continues_the_run(make_cfg, capsys):
    """Trained 2 steps with the all_to_all exchange (the uninterrupted run, stopped at its step-2
    checkpoint) and resumed to 4 with all_gather and the grouped matmul named (xla, where the
    run said auto): the same run, whose losses are the uninterrupted run's within float
    rounding. Another emb_dim is another run: refused."""
    whole = make_cfg(*MOE_ON_TWO, "run.name=whole")
    run(whole)
    other_computation = ("compute.expert_exchange=all_gather", "compute.grouped_matmul=xla")
    resumed = make_cfg(*MOE_ON_TWO, "run.name=resumed", *other_computation)
    stopped_at(whole.run_dir, 2, resumed.run_dir)
    capsys.readouterr()
    run(resumed)
    assert "resumed at step 2" in capsys.readouterr().out
    got, want = losses(resumed.run_dir), losses(whole.run_dir)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)
    with pytest.raises(ChangedRun, match=r"model.emb_dim: 64 -> 32; give this config") as e:
        run(make_cfg(*MOE_ON_TWO, "run.name=resumed", "model.emb_dim=32"))
    assert "\n" not in str(e.value)
