"""Refused inputs, one row each: exit status 2, exactly one line on stderr that starts with the
program's name and names the offending key, path or value, no traceback, and nothing already
on disk changed. A new key, file kind or tool argument is covered by adding a row.

Rows run each command's `main(argv)` in this process (milliseconds for config mistakes); a few
run as real subprocesses, to prove the exit status and that no traceback escapes the
interpreter. Every config key's domain is walked in test_config_domains.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from support.data import load_tool, prepared
from support.runs import tree_digest
from support.xla_env import xla_flags

from maxtrain import config as config_lib
from maxtrain import quantization
from maxtrain.checkpointing.export import save_parameters
from maxtrain.common.errors import DEBUG_ENV
from maxtrain.config import ConfigError
from maxtrain.hf import cli as hf_cli
from maxtrain.surgery import cli as transforms_cli
from maxtrain.tokenizers import DEFAULT_TOKENIZER
from maxtrain.training import loop as train_lib
from maxtrain.training.run_model import model_def

BASE = str(config_lib.CONFIGS_DIR / "base.yml")
TOKENIZER = str(DEFAULT_TOKENIZER)
# The tiny model on synthetic data, writing under the test's own directory ({out}).
TINY = [BASE, "model_name=tiny", "data.kind=synthetic", "run.output_dir={out}",
        "run.compilation_cache_dir=", "train.steps=2", "train.global_batch_size=8",
        "train.seq_len=32", "train.eval_every=0"]  # fmt: skip


def source(path: str) -> list[str]:
    """The overrides of a one-source grain mixture."""
    return ["data.kind=grain", f"data.sources=[{{name: web, path: {path}}}]"]


def _tool(name: str):
    return lambda argv: load_tool(name).main(argv)


PROGRAMS = {
    "maxtrain": train_lib.main,
    "benchmark": _tool("benchmark"),
    "benchmark_data": _tool("benchmark_data"),
    "show_data": _tool("show_data"),
    "prepare_data": _tool("prepare_data"),
    "train_tokenizer": _tool("train_tokenizer"),
    "quantize": _tool("quantize"),
    "convert_hf": hf_cli.main,
    "upcycle": lambda argv: transforms_cli.main("upcycle", argv, "upcycle"),
    "depth_upscale": lambda argv: transforms_cli.main("depth_upscale", argv, "depth_upscale"),
}

# (row id, program, argv, what the line must say); {in}: the shared inputs below, {out}: the
# test's own empty directory. Both must be unchanged afterwards.
ROWS = [
    # ---- config values and override syntax
    ("unknown key", "maxtrain", [*TINY, "optim.lrr=1"], "unknown config key 'optim.lrr'"),
    ("bad type", "maxtrain", [*TINY, "train.steps=many"],
     "config key 'train.steps' must be an integer (got 'many')"),
    ("head_dim 0", "maxtrain", [*TINY, "model.head_dim=0"],
     "config key 'model.head_dim' must be > 0 (got 0)"),
    ("head_dim -4", "maxtrain", [*TINY, "model.head_dim=-4"],
     "config key 'model.head_dim' must be > 0 (got -4)"),
    ("lr inf", "maxtrain", [*TINY, "optim.lr=.inf"],
     "config key 'optim.lr' must be a finite number (got inf)"),
    ("rope theta 0", "maxtrain", [*TINY, "model.rope.theta=0"],
     "config key 'model.rope.theta' must be > 0 (got 0)"),
    ("partial RoPE of an odd count", "maxtrain", [*TINY, "model.rope.fraction=0.3"],
     "model.rope.fraction (0.3) x head_dim (16) = 4.8 dims to rotate, not an even"),
    ("b1 1.5", "maxtrain", [*TINY, "optim.b1=1.5"], "config key 'optim.b1' must be < 1 (got 1.5)"),
    ("eps nan", "maxtrain", [*TINY, "optim.eps=.nan"], "'optim.eps' must be a finite number"),
    ("mesh degree 0", "maxtrain", [*TINY, "mesh.fsdp=0"],
     "config key 'mesh.fsdp' must be positive or -1 (got 0)"),
    ("profile step 0", "maxtrain", [*TINY, "profile.start_step=0"],
     "config key 'profile.start_step' must be positive or -1 (got 0)"),
    ("choice", "maxtrain", [*TINY, "compute.remat=some"],
     "config key 'compute.remat' must be one of 'none', 'full' or 'minimal' (got 'some')"),
    ("list item", "maxtrain", [*TINY, "init.layer_map=[0, -1]"],
     "config key 'init.layer_map[1]' must be >= 0 (got -1)"),
    ("rope band", "maxtrain", [*TINY, "model.rope.scaling={low_freq_factor: 5.0}"],
     "high_freq_factor (4.0) must be at least model.rope.scaling.low_freq_factor (5.0)"),
    ("no =", "maxtrain", [*TINY, "optim.lr"], "override 'optim.lr' is not of the form key=value"),
    ("empty key", "maxtrain", [*TINY, "=3"], "override '=3' has an empty key"),
    ("empty key part", "maxtrain", [*TINY, "optim..lr=3"],
     "override 'optim..lr=3' has an empty key"),
    ("unknown model", "maxtrain", [*TINY, "model_name=llama-8b"],
     "model_name 'llama-8b' has no file"),
    ("model file missing", "maxtrain", [*TINY, "model_name={in}/imported/model.yml"],
     "model_name '{in}/imported/model.yml': no such model file"),
    ("stage -1", "maxtrain", [*TINY, "mesh.stage=-1"],
     "config key 'mesh.stage' must be > 0 (got -1)"),
    ("pipeline schedule", "maxtrain", [*TINY, "pipeline.schedule=zbv"],
     "config key 'pipeline.schedule' must be one of 'gpipe', 'circular', '1f1b', "
     "'interleaved_1f1b' or 'zero_bubble' (got 'zbv')"),
    ("interleaved micro-batches", "maxtrain",
     [*TINY, "mesh.stage=2", "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=3",
      "train.global_batch_size=12"],
     "pipeline.microbatches=3 is no multiple of the 2 stages"),
    ("in-schedule mtp", "maxtrain",
     [*TINY, "mesh.stage=2", "pipeline.schedule=1f1b", "model.mtp.depth=1"],
     "pipeline.schedule=1f1b does not work with model.mtp.depth > 0"),
    ("gpipe repeats", "maxtrain", [*TINY, "pipeline.repeats=2"],
     "pipeline.repeats=2 needs pipeline.schedule=circular"),
    ("stages x repeats", "maxtrain",
     [*TINY, "mesh.stage=2", "pipeline.schedule=circular", "pipeline.repeats=2"],
     "model.num_layers=2 leaves 2 layers, not divisible into 2 stages x pipeline.repeats=2"),
    ("too few micro-batches", "maxtrain", [*TINY, "mesh.stage=2", "pipeline.microbatches=1"],
     "pipeline.microbatches=1 is fewer than the 2 stages"),
    ("context split", "maxtrain", [*TINY, "mesh.context=4", "train.seq_len=36"],
     "train.seq_len=36 must be divisible by 8 (compute.context_layout=balanced over a context "
     "degree of 4)"),
    ("context split of linear layers", "maxtrain",
     [*TINY, "mesh.context=2", "model.layers=[linear-dense, global-dense]",
      "model.linear_attention={num_key_heads: 1, num_value_heads: 2}"],
     "mesh.context=2 splits attention layers only: model.layers' linear layers"),
    ("stages of different mixers", "maxtrain",
     [*TINY, "mesh.stage=2", "model.layers=[linear-dense, global-dense]",
      "model.linear_attention={num_key_heads: 1, num_value_heads: 2}"],
     "pipeline groups of 1 layers hold different kinds of layers: model.layers must repeat "
     "every 1 layers"),
    ("linear layers without their section", "maxtrain",
     [*TINY, "model.layers=[linear-dense, global-dense]"],
     "model.layers has linear layers, which need model.linear_attention"),
    ("context exchange", "maxtrain", [*TINY, "compute.context_exchange=ulysses"],
     "config key 'compute.context_exchange' must be one of 'all_gather' or 'ring'"),
    ("mesh too big", "maxtrain", [*TINY, "mesh.fsdp=3"], "use 3 devices per slice but 8 are"),
    ("tiles of quantized experts", "maxtrain",
     [*TINY, "model_name=tiny-moe", "quantization.preset=int8",
      "compute.grouped_matmul_tiles={gate_up: {forward: {tile_m: 256}}}"],
     "compute.grouped_matmul_tiles tiles the float grouped matmul, but quantized training"),
    ("grouped matmul tile projection", "maxtrain",
     [*TINY, "model_name=tiny-moe", "compute.grouped_matmul_tiles={up: {forward: {}}}"],
     "config key 'compute.grouped_matmul_tiles.up' must be one of 'gate_up' or 'down' "
     "(got 'up')"),
    ("grouped matmul tile pass", "maxtrain",
     [*TINY, "model_name=tiny-moe", "compute.grouped_matmul_tiles={down: {backward: {}}}"],
     "unknown config key 'compute.grouped_matmul_tiles.down.backward'; did you mean "
     "'compute.grouped_matmul_tiles.down.forward'?"),
    ("an old key in a new place", "maxtrain", [*TINY, "compute.ep_dispatch=ragged"],
     "unknown config key 'compute.ep_dispatch'; it is now compute.expert_exchange"),
    # ---- config files
    ("no config", "maxtrain", [], "no config file given"),
    ("missing file", "maxtrain", ["{in}/nope.yml"], "config file not found: {in}/nope.yml"),
    ("a directory", "maxtrain", ["{in}"], "config file {in} is a directory, not a YAML file"),
    ("only overrides", "maxtrain", ["optim.lr=1e-3"], "no config file given"),
    ("invalid YAML", "maxtrain", ["{in}/invalid.yml"],
     "config file {in}/invalid.yml is not valid YAML: did not find expected ',' or ']' at line 3"),
    ("not UTF-8", "maxtrain", ["{in}/latin1.yml"],
     "config file {in}/latin1.yml is not UTF-8 text: byte 22 is b'\\xe9'"),
    ("not a mapping", "maxtrain", ["{in}/list.yml"], "{in}/list.yml must hold a mapping"),
    ("base_config cycle", "maxtrain", ["{in}/cycle_a.yml"], "base_config cycle: {in}/cycle_a.yml"),
    # ---- data
    ("source missing", "maxtrain", [*TINY, *source("{in}/none/*.arrayrecord")],
     "data.sources[web]: no .arrayrecord shards match '{in}/none/*.arrayrecord'"),
    ("corrupt shard", "maxtrain",
     [*TINY, "model_name=small", *source("{in}/corrupt")],
     "corrupt ArrayRecord file {in}/corrupt/shard-00001.arrayrecord"),
    ("vocab mismatch", "maxtrain", [*TINY, *source("{in}/source")],
     "vocab of 1024, larger than the model's vocab_size 256; train on data prepared with the "
     "model's own tokenizer"),
    ("not a tokenizer", "prepare_data",
     ["--input", "{in}/corpus.jsonl", "--tokenizer", "{in}/bad.model", "--output", "{out}/src"],
     "{in}/bad.model is not a valid sentencepiece model"),
    ("no input files", "prepare_data",
     ["--input", "{in}/*.parquet", "--tokenizer", TOKENIZER, "--output", "{out}/src"],
     "no files match '{in}/*.parquet'"),
    # ---- checkpoints (a train run compiles the state first: one row of it is enough)
    ("checkpoint of another model", "maxtrain",
     [*TINY, "checkpoint.load_parameters_path={in}/ckpt", "model.mlp_dim=96"],
     "checkpoint {in}/ckpt/0 does not match the model: 'params/layers/mlp/down/kernel' has "
     "shape (2, 128, 64) in the checkpoint, the model expects (2, 96, 64)"),
    # A refused start removes the run.output_dir it created ({out}/new/runs: two levels).
    ("another model, new output dir", "maxtrain",
     [*TINY, "run.output_dir={out}/new/runs", "checkpoint.load_parameters_path={in}/ckpt",
      "model.mlp_dim=96"], "does not match the model"),
    ("load_parameters_path missing", "maxtrain",
     [*TINY, "run.output_dir={out}/new/runs", "checkpoint.load_parameters_path={in}/nowhere"],
     "no complete checkpoint found at {in}/nowhere"),
    ("checkpoint dir under a file", "maxtrain",
     [*TINY, "run.output_dir={out}/new/runs", "checkpoint.local.dir={in}/corpus.jsonl/local"],
     "{in}/corpus.jsonl/local"),
    ("output dir under a file", "maxtrain", [*TINY, "run.output_dir={in}/corpus.jsonl/runs"],
     "cannot create the run directory {in}/corpus.jsonl/runs/default (run.output_dir/run.name): "
     "Not a directory"),
    ("unknown embedded source", "maxtrain",
     [*TINY, "data.kind=grain", "data.cache_dir={out}/cache",
      "data.sources=[{name: poems, path: 'embedded:poetry'}]"],
     "unknown embedded source 'embedded:poetry'; the embedded corpus has embedded:code, "
     "embedded:math, embedded:prose"),
    ("upcycle source missing", "upcycle",
     [BASE, "model_name=tiny-moe", "model.vocab_size=256", "model.moe.expert_mlp_dim=64",
      "init.source_model=tiny", "--source", "{in}/nowhere",
      "--output", "{out}/moe"], "no complete checkpoint found at {in}/nowhere"),
    # ---- Hugging Face directories
    ("HF dir missing", "convert_hf", ["import", "--hf-dir", "{in}/nowhere", "--output", "{out}/c"],
     "{in}/nowhere"),
    ("HF dir without config.json", "convert_hf",
     ["import", "--hf-dir", "{in}", "--output", "{out}/c"], "no config.json"),
    # ---- tool arguments
    ("benchmark --steps 0", "benchmark", [BASE, "--steps", "0"],
     "argument --steps: must be at least 1, not 0"),
    ("benchmark config", "benchmark", [BASE, "optim.b1=1", "--dry-run"],
     "config key 'optim.b1' must be < 1 (got 1)"),
    ("benchmark --device unknown", "benchmark", [BASE, "--dry-run", "--device", "abacus"],
     "--device 'abacus': memory not known; known: cpu, tpu v6 lite"),
    ("benchmark_data --batches x", "benchmark_data", [BASE, "--batches", "x"],
     "argument --batches: must be an integer, not 'x'"),
    ("show_data --steps 0", "show_data", [BASE, "--steps", "0", "--out", "{out}/b.npz"],
     "argument --steps: must be at least 1, not 0"),
    ("export --max-shard-gb 0", "convert_hf",
     ["export", "--checkpoint", "{in}/ckpt", "--output", "{out}/hf", "--max-shard-gb", "0"],
     "argument --max-shard-gb: must be a finite number above 0, not 0"),
    ("export of a quantized checkpoint", "convert_hf",
     ["export", "--checkpoint", "{in}/ptq", "--output", "{out}/hf"],
     "checkpoint {in}/ptq/0 holds int8 post-training-quantized weights (tools/quantize.py), "
     "which export does not write"),
    ("upcycle without --source", "upcycle", [BASE, "--output", "{out}/moe"],
     "the following arguments are required: --source"),
    ("quantize config", "quantize",
     [BASE, "optim.lrr=1", "--source", "{in}/ckpt", "--output", "{out}/q"],
     "unknown config key 'optim.lrr'"),
    ("train_tokenizer --vocab-size 0", "train_tokenizer",
     ["--input", "{in}/corpus.jsonl", "--output", "{out}/tok", "--vocab-size", "0"],
     "--vocab-size and --max-docs must be at least 1"),
]  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Every file a row refuses, made once: bad configs, data, a checkpoint, a model dir."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "invalid.yml").write_text("model_name: tiny\noptim: [1\n")
    (root / "latin1.yml").write_bytes(b"model_name: tiny\n# caf\xe9\n")  # byte 22 is \xe9
    (root / "list.yml").write_text("- model_name\n")
    (root / "cycle_a.yml").write_text("base_config: cycle_b.yml\n")
    (root / "cycle_b.yml").write_text("base_config: cycle_a.yml\n")
    (root / "bad.model").write_bytes(b"\x00not a sentencepiece model")
    (root / "corpus.jsonl").write_text('{"text": "one document"}\n')
    docs = [f"document {i} " * 50 for i in range(40)]
    prepared(root, docs, name="source")
    corrupt = prepared(root, docs, name="corrupt", docs_per_shard=20)
    shard = corrupt / "shard-00001.arrayrecord"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cfg = config_lib.load(BASE, ["model_name=tiny", "data.kind=synthetic"])
    abstract = nnx.to_pure_dict(model_def(cfg).abstract_state)  # the shapes are what count
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)
    save_parameters(root / "ckpt", params, config_yaml=config_lib.to_yaml(cfg))
    kernels = quantization.quantizable_kernels(model_def(cfg).abstract_state)
    qparams, _ = quantization.quantize_params(params, kernels, "int8")
    meta = {"quantization": {"qtype": "int8", "source": "ckpt"}}
    save_parameters(root / "ptq", qparams, config_yaml=config_lib.to_yaml(cfg), meta=meta)
    return root


def fill(text: str, paths: dict[str, Path]) -> str:
    """'{in}/x' -> '<inputs>/x' (str.format would trip over YAML's braces)."""
    for name, path in paths.items():
        text = text.replace(f"{{{name}}}", str(path))
    return text


# Refusals that need the run's state or its directories: they come after the run has said
# that it prepares them. Every other refused run says nothing on stdout ("preparing ..." once
# came before config and data mistakes too).
AFTER_PREPARING = {
    "checkpoint of another model", "another model, new output dir",
    "load_parameters_path missing", "checkpoint dir under a file", "output dir under a file",
}  # fmt: skip


def run_in_process(program: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of PROG's main(argv); an argparse error exits via
    SystemExit."""
    capsys.readouterr()
    try:
        status = PROGRAMS[program](argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_refused(status: int, stderr: str, program: str, expected: str) -> None:
    assert status == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.endswith("\n"), stderr  # exactly one line
    assert stderr.startswith(f"{program}") and ": error: " in stderr, stderr
    assert expected in stderr, stderr


@pytest.mark.parametrize(
    ("program", "argv", "expected"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS]
)
def test_refused_input_is_one_line_exit_2_and_changes_nothing(
    program, argv, expected, inputs, tmp_path, capsys, monkeypatch, request
):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    paths = {"in": inputs, "out": tmp_path}
    before = tree_digest(inputs), tree_digest(tmp_path)
    status, stdout, stderr = run_in_process(program, [fill(a, paths) for a in argv], capsys)
    assert_refused(status, stderr, program, fill(expected, paths))
    assert (tree_digest(inputs), tree_digest(tmp_path)) == before
    if program == "maxtrain" and request.node.callspec.id not in AFTER_PREPARING:
        assert stdout == "", stdout


def test_debug_shows_the_traceback_too_and_exits_2(tmp_path, capsys, monkeypatch):
    """--debug (maxtrain.train: a leading --debug; tools: the flag) or MAXTRAIN_DEBUG=1: the
    traceback before the one line, and the exit status of any refusal (it was 1)."""
    bad = [*(fill(a, {"out": tmp_path}) for a in TINY), "optim.b1=1.5"]
    line = "error: config key 'optim.b1' must be < 1 (got 1.5)\n"
    for debug, program, argv in [
        ("1", train_lib.main, bad),
        ("0", train_lib.main, ["--debug", *bad]),
        ("0", PROGRAMS["benchmark"], [*bad, "--dry-run", "--debug"]),
    ]:
        monkeypatch.setenv(DEBUG_ENV, debug)
        assert program(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):") and err.endswith(line), err
        assert "ConfigError: config key 'optim.b1' must be < 1" in err
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert train_lib.main(bad) == 2 and capsys.readouterr().err == f"maxtrain: {line}"


def test_a_message_of_several_lines_is_printed_as_one(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def fails(*args, **kwargs):
        raise ConfigError("first\n  second\n\nthird")

    monkeypatch.setattr(train_lib, "run", fails)
    assert train_lib.main([BASE, "model_name=tiny"]) == 2
    assert capsys.readouterr().err == "maxtrain: error: first second third\n"


def test_a_data_mistake_is_refused_before_anything_compiles(tmp_path, capsys, monkeypatch):
    """train.run checks the data before it builds (and compiles) the train state."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("build_trainer ran before the data was checked")

    monkeypatch.setattr(train_lib, "build_trainer", must_not_run)
    argv = [*(fill(a, {"out": tmp_path}) for a in TINY), *source(tmp_path / "x")]
    status, stdout, stderr = run_in_process("maxtrain", argv, capsys)
    assert_refused(status, stderr, "maxtrain", "no .arrayrecord shards match")
    assert stdout == ""


def test_at_the_process_boundary_exit_2_one_line_no_traceback(tmp_path):
    """Two real interpreters at once, the train command and a tool's script: the real exit
    status, and no traceback from anywhere in the interpreter."""
    (tmp_path / "latin1.yml").write_bytes(b"model_name: tiny\n# caf\xe9\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    env.pop(DEBUG_ENV, None)
    tool = str(config_lib.REPO_ROOT / "tools" / "benchmark.py")
    commands = {
        "maxtrain": ([sys.executable, "-m", "maxtrain.train", str(tmp_path / "latin1.yml")], env),
        "benchmark": ([sys.executable, tool, BASE, "--steps", "0"], env),
    }
    running = {
        name: subprocess.Popen(cmd, env=e, cwd=config_lib.REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        for name, (cmd, e) in commands.items()
    }  # fmt: skip
    done = {name: (p.wait(timeout=120), p.communicate()[1]) for name, p in running.items()}
    assert_refused(*done["maxtrain"], "maxtrain", "latin1.yml is not UTF-8 text: byte 22")
    assert_refused(*done["benchmark"], "benchmark", "argument --steps: must be at least 1")
    assert list(tmp_path.iterdir()) == [tmp_path / "latin1.yml"]
