"""What makes a run the run it is (maxtrain/training/run_identity.py), compared key by key."""

import os

from maxtrain import config as config_lib
from maxtrain.training.run_identity import differences

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
