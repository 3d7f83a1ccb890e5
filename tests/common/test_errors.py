"""The command-line grammar every entry point shares (maxtrain/common/errors.py): the one path
among a command's positionals is the config or the checkpoint, wherever it stands."""

import pytest

from maxtrain import evaluate, generate
from maxtrain.common.errors import path_first


def test_the_path_goes_first_and_the_overrides_keep_their_order():
    assert path_first(["mesh.fsdp=1", "runs/default", "mesh.tensor=2"]) == [
        "runs/default", "mesh.fsdp=1", "mesh.tensor=2",
    ]  # fmt: skip
    assert path_first(["runs/default", "a=1"]) == ["runs/default", "a=1"]
    # None or two paths: left as they were, for the command to refuse.
    assert path_first(["a=1", "b=2"]) == ["a=1", "b=2"]
    assert path_first(["x", "a=1", "y"]) == ["x", "a=1", "y"]


@pytest.mark.parametrize(
    ("main", "options"), [(generate.main, ["--prompt", "hi"]), (evaluate.main, [])],
    ids=["generate", "evaluate"],
)  # fmt: skip
def test_an_override_before_the_checkpoint_is_no_checkpoint(main, options, tmp_path, capsys):
    """`generate mesh.fsdp=1 runs/default` read mesh.fsdp=1 as the checkpoint's path."""
    assert main(["mesh.fsdp=1", str(tmp_path / "run"), *options]) == 2
    assert f"no complete checkpoint found at {tmp_path / 'run'}" in capsys.readouterr().err
