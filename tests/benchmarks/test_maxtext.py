"""maxtrain beside MaxText (maxtrain/benchmarks/maxtext.py): the command line of maxtrain's side
runs from any working directory, and MaxText's side names the same shape in keys MaxText has.
MaxText itself is not installed here, nor is its side run."""

import json
import sys
from pathlib import Path

import pytest
from support import REPO

from maxtrain.benchmarks import maxtext
from maxtrain.benchmarks import step as benchmark
from maxtrain.config import preset

# MaxText 0.2.5's configs/base.yml keys (the fixture says how it was made).
MAXTEXT_KEYS = {
    line
    for line in (REPO / "tests/fixtures/maxtext/base-0.2.5-keys.txt").read_text().splitlines()
    if not line.startswith("#")
}


def test_the_maxtrain_side_runs_from_the_checkout(capsys, tmp_path, monkeypatch):
    """Its paths are the checkout's (they once pointed into the package, and the documented
    comparison stopped at "config file not found"); with the TPU compile left out (libtpu,
    minutes), the command runs from another directory: the config and its overrides validate
    and the dry run is for the topology's 16 chips."""
    command = maxtext.maxtrain_command(maxtext.Comparison("dense-1.5b", "v5e:4x4", "plain"))
    assert command[0] == sys.executable and Path(command[1]) == REPO / "tools" / "benchmark.py"
    assert Path(command[2]) == REPO / "configs" / "base.yml"
    compile_flags = command.index("--compile")
    assert command[compile_flags:] == ["--compile", "--topology", "v5e:4x4"]
    monkeypatch.chdir(tmp_path)
    dry_run = [*command[2:compile_flags], "--devices", "16", "--device", "TPU v5e"]
    assert benchmark.main(dry_run) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (result["model"], result["devices"], result["mesh"]) == ("dense-1.5b", 16, {"fsdp": 16})


@pytest.mark.parametrize("shape", [*maxtext.DENSE_SHAPES, *maxtext.MOE_SHAPES])
def test_maxtext_gets_the_presets_shape_in_its_own_keys(shape):
    """Every key is one of MaxText's (a misspelt key would stop its compile, or worse, be
    read as a different model), and the shape is the preset's: its layers, widths, heads,
    experts and tied head, on both sides the same number of layers and the same expert split."""
    run = maxtext.Comparison(shape, "v5e:4x4", layers=3 if shape in maxtext.MOE_SHAPES else None)
    settings, model = maxtext.maxtext_settings(run), preset(shape)
    assert set(settings) <= MAXTEXT_KEYS
    assert (settings["base_emb_dim"], settings["vocab_size"]) == (model.emb_dim, model.vocab_size)
    assert (
        settings["base_num_query_heads"],
        settings["base_num_kv_heads"],
        settings["head_dim"],
    ) == (
        model.num_heads,
        model.num_kv_heads,
        model.head_dim or model.emb_dim // model.num_heads,  # the schema's default
    )
    assert settings["logits_via_embedding"] == str(model.tie_embeddings).lower()
    command = maxtext.maxtrain_command(run)
    layers = run.layers or model.num_layers
    assert settings["base_num_decoder_layers"] == layers
    assert f"model.num_layers={layers}" in command or run.layers is None
    if model.moe is None:
        assert (settings["decoder_block"], settings["base_mlp_dim"]) == ("llama2", model.mlp_dim)
        return
    moe = (settings["num_experts"], settings["num_experts_per_tok"], settings["base_moe_mlp_dim"])
    assert moe == (model.moe.num_experts, model.moe.top_k, model.moe.expert_mlp_dim)
    assert settings["base_mlp_dim"] == model.moe.expert_mlp_dim  # MaxText: all-MoE needs both
    block = "qwen3_moe" if model.qk_norm == "rms" else "mixtral"
    assert (settings["decoder_block"], settings["use_qk_norm"]) == (
        block,
        str(block != "mixtral").lower(),
    )
    assert "compute.grouped_matmul=tokamax" in command and "mesh.expert=1" in command


def test_an_expert_split_is_the_same_on_both_sides_or_refused(capsys):
    """--expert 4 on qwen3's 128 experts over 16 chips: expert 4 x fsdp 4 for maxtrain,
    ici_expert_parallelism 4 (FSDP the rest) for MaxText. On a dense shape, or a split that
    does not divide the experts (mixtral's 8 over 16), it is refused in one line before any
    compile."""
    run = maxtext.Comparison("qwen3-30b-a3b", "v5e:4x4", expert=4)
    assert {"mesh.expert=4", "mesh.fsdp=4"} <= set(maxtext.maxtrain_command(run))
    settings = maxtext.maxtext_settings(run)
    assert (settings["ici_expert_parallelism"], settings["ici_fsdp_parallelism"]) == (4, -1)
    assert settings["allow_split_physical_axes"] == "true"  # else MaxText refuses 8 on a 4x4
    for shape, expert in (("dense-1.5b", 2), ("mixtral-8x7b", 16)):
        argv = ["--maxtext-python", sys.executable, "--shape", shape, "--expert", str(expert)]
        assert maxtext.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"compare_maxtext: error: --expert {expert}:") and "\n" not in err
