"""maxtrain beside MaxText (maxtrain/benchmarks/maxtext.py): the command line of maxtrain's side
runs from any working directory. MaxText itself is not installed here, nor is its side run."""

import json
import sys
from pathlib import Path

from support import REPO

from maxtrain.benchmarks import maxtext
from maxtrain.benchmarks import step as benchmark


def test_the_maxtrain_side_runs_from_the_checkout(capsys, tmp_path, monkeypatch):
    """Its paths are the checkout's (they once pointed into the package, and the documented
    comparison stopped at "config file not found"); with the TPU compile left out (libtpu,
    minutes), the command runs from another directory: the config and its overrides validate
    and the dry run is for the topology's 16 chips."""
    command = maxtext.maxtrain_command("dense-1.5b", "v5e:4x4", "plain", unrolled=False)
    assert command[0] == sys.executable and Path(command[1]) == REPO / "tools" / "benchmark.py"
    assert Path(command[2]) == REPO / "configs" / "base.yml"
    compile_flags = command.index("--compile")
    assert command[compile_flags:] == ["--compile", "--topology", "v5e:4x4"]
    monkeypatch.chdir(tmp_path)
    dry_run = [*command[2:compile_flags], "--devices", "16", "--device", "TPU v5e"]
    assert benchmark.main(dry_run) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (result["model"], result["devices"], result["mesh"]) == ("dense-1.5b", 16, {"fsdp": 16})
