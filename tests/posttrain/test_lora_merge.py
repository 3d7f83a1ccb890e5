"""Merging a LoRA run's adapters into its base (maxtrain/posttrain/merging.py,
tools/merge_lora.py):
the merged checkpoint computes the adapted model's function (QLoRA: on the dequantized base),
exports to Hugging Face with the merged weights, and loads wherever a model checkpoint does;
a LoRA run's own checkpoint loads as that merged model."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain import optim
from maxtrain.checkpointing import read_saved_config
from maxtrain.checkpointing.export import save_parameters
from maxtrain.data.shards import data_tokenizer
from maxtrain.hf import ConversionError
from maxtrain.hf.convert import export_checkpoint
from maxtrain.inference.loading import data_tokenizer_path, load_model
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.posttrain import lora, merge_cli
from maxtrain.surgery.initialize import initial_params
from maxtrain.tokenizers import DEFAULT_TOKENIZER
from maxtrain.training import run_model
from maxtrain.training.run_model import model_def
from maxtrain.training.state import abstract_frozen, frozen_state, state_shardings

BASE = config_lib.CONFIGS_DIR / "base.yml"
MERGE_LORA = merge_cli.main
T = 16  # sequence length of the logits compared


def config(tmp: Path, model: str, *overrides: str) -> config_lib.Config:
    return config_lib.load(
        BASE,
        [
            f"model_name={model}",
            "compute.compute_dtype=float32",  # 1e-5 compares the functions, not bf16 rounding
            "data.kind=synthetic",
            f"run.output_dir={tmp}",
            "train.seq_len=32",
            *overrides,
        ],
    )


def lora_run(tmp: Path, model: str, *lora_keys: str):
    """A base checkpoint and a LoRA run's checkpoint on it, whose adapters have B set by hand
    (nonzero: the adapted model differs from the base). Returns (the run's config, the
    adapted model's logits as the run computes them: its frozen base as training/state.py keeps it,
    with the adapters beside it, run by the LoRA model: Qwix's provider on the projections,
    the experts' own adapter path)."""
    base_cfg = config(tmp, model)
    spec = run_model.model_spec(base_cfg)
    init = lambda: nnx.to_pure_dict(nnx.state(model_lib.build(spec, 1), nnx.Param))  # noqa: E731
    save_parameters(tmp / "base", jax.jit(init)(), config_yaml=config_lib.to_yaml(base_cfg))
    cfg = config(tmp, model, f"checkpoint.load_parameters_path={tmp / 'base'}", *lora_keys)

    mesh = build_mesh(cfg.mesh)
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = model_def(cfg, pipelined=False)
        shardings = state_shardings(mdef, cfg, mesh, optim.build(cfg.optim, 4)[0])
    loaded = initial_params(cfg, abstract_frozen(mdef, cfg, mesh))
    frozen = frozen_state(cfg, mdef, shardings, loaded)
    built = jax.jit(lambda: nnx.state(run_model.build_model(cfg, 2), nnx.Param))()
    adapters = lora.split(nnx.to_pure_dict(built))[0]
    keys = iter(jax.random.split(jax.random.key(3), 64))
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            0.05 * jax.random.normal(next(keys), x.shape, x.dtype)
            if str(path[-1].key) == lora.B
            else x
        ),
        adapters,
    )
    # The item a LoRA run's checkpoint holds its adapters in (its optimizer state aside).
    save_parameters(tmp / "run", adapters, config_yaml=config_lib.to_yaml(cfg))
    adapters = jax.device_put(adapters, NamedSharding(mesh, P()))
    return cfg, logits(mdef, lora.combine(frozen, adapters), cfg.model.vocab_size)


def logits(mdef, params, vocab: int) -> np.ndarray:
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, vocab)
    positions = jnp.tile(jnp.arange(T), (2, 1))
    out = jax.jit(mdef.apply)(params, tokens, positions, jnp.ones_like(tokens)).logits
    return np.asarray(out)


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def hf_weight(kernel: jax.Array, inputs: int) -> np.ndarray:
    """A kernel of ours as transformers stores it: [out, in], heads flattened."""
    kernel = np.asarray(kernel)
    return kernel.reshape(int(np.prod(kernel.shape[:inputs])), -1).T


# (model, lora keys, Hugging Face tensors each module kind's adapters change: (name, our path,
# index, input axes))
CASES = {
    "dense-attention-mlp": (
        "tiny",
        ("lora.rank=4", "lora.modules=[attention,mlp]"),
        [
            ("model.layers.0.self_attn.q_proj.weight", ("attn", "q"), (0,), 1),
            ("model.layers.1.self_attn.o_proj.weight", ("attn", "o"), (1,), 2),
            ("model.layers.1.mlp.down_proj.weight", ("mlp", "down"), (1,), 1),
        ],
    ),
    "moe-experts-qlora-nf4": (
        "tiny-moe",
        (
            "lora.rank=4",
            "lora.modules=[experts]",
            "lora.base_quantization=nf4",
            "lora.block_size=32",
        ),
        [("model.layers.1.block_sparse_moe.experts.3.w2.weight", ("moe", "down"), (1, 3), 1)],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_merged_checkpoint_is_the_adapted_model_and_exports_its_weights(case, tmp_path, capsys):
    model, lora_keys, tensors = CASES[case]
    cfg, adapted = lora_run(tmp_path, model, *lora_keys)
    shutil.copyfile(DEFAULT_TOKENIZER, tmp_path / "base" / "tokenizer.model")  # as an import's
    assert MERGE_LORA([str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    assert "merge_lora: wrote" in capsys.readouterr().out
    step_dir = tmp_path / "merged" / "0"
    assert (tmp_path / "merged" / "tokenizer.model").read_bytes() == DEFAULT_TOKENIZER.read_bytes()

    merged = load_model(tmp_path / "merged")  # as generate/evaluate load any checkpoint
    assert not merged.cfg.lora.enabled
    saved = yaml.safe_load(read_saved_config(step_dir))
    assert saved["lora"]["rank"] == 0
    assert saved["checkpoint"]["load_parameters_path"] == str(tmp_path / "merged")
    assert max_diff(logits(merged.mdef, merged.params, cfg.model.vocab_size), adapted) < 1e-5
    base = load_model(tmp_path / "base")
    base_logits = logits(base.mdef, base.params, cfg.model.vocab_size)
    assert max_diff(base_logits, adapted) > 1e-2  # the adapters change the function

    direct = load_model(tmp_path / "run")  # a LoRA run's own checkpoint: merged on the fly
    jax.tree.map(np.testing.assert_array_equal, direct.params, merged.params)
    start = load_model(tmp_path / "run", initial=True)  # its start: the base, as the run kept it
    start_logits = logits(start.mdef, start.params, cfg.model.vocab_size)
    if cfg.lora.base_quantization == "none":
        jax.tree.map(np.testing.assert_array_equal, start.params, base.params)
    else:  # the quantized base, dequantized: a function near the float base's
        assert 1e-4 < max_diff(start_logits, base_logits) < 0.1

    export_checkpoint(tmp_path / "merged", tmp_path / "hf")
    exported = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        exported |= load_file(file)
    stack = "layers" if cfg.model.moe is None else "moe_layers"
    for name, path, index, inputs in tensors:
        kernel = merged.params[stack]
        for key in path:
            kernel = kernel[key]
        want = hf_weight(kernel["kernel"][index], inputs)
        np.testing.assert_array_equal(exported[name], want, err_msg=name)
        before = base.params[stack]
        for key in path:
            before = before[key]
        assert max_diff(hf_weight(before["kernel"][index], inputs), want) > 1e-3, name


def test_bad_input_is_refused_in_one_line(tmp_path, capsys):
    model, lora_keys, _ = CASES["dense-attention-mlp"]  # its programs: compiled once, above
    lora_run(tmp_path, model, *lora_keys)

    def refused(*argv) -> str:
        assert MERGE_LORA([*map(str, argv)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("merge_lora: error: ") and err.count("\n") == 1
        return err

    assert "is not a LoRA run's checkpoint" in refused(tmp_path / "base", tmp_path / "out")
    assert "no complete checkpoint found" in refused(tmp_path / "none", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    assert "taken already exists" in refused(tmp_path / "run", tmp_path / "taken")
    moved = f"checkpoint.load_parameters_path={tmp_path / 'gone'}"
    err = refused(tmp_path / "run", tmp_path / "out", moved)
    assert "the base model of the LoRA run" in err and str(tmp_path / "gone") in err
    assert not (tmp_path / "out").exists()
    # Exporting the adapters alone would write no model: export says to merge first.
    with pytest.raises(ConversionError, match="holds a LoRA run's adapters.*merge_lora"):
        export_checkpoint(tmp_path / "run", tmp_path / "hf")


def test_a_chat_run_names_the_tokenizer_its_text_was_encoded_with(make_cfg, tmp_path):
    """Fine-tuning runs (LoRA or not) read chat text, tokenized as it is read: generate,
    evaluate and export find the tokenizer in data.tokenizer, else the committed default."""
    chat = config_lib.REPO_ROOT / "maxtrain" / "data" / "assets" / "chat.jsonl"
    sources = f"data.sources=[{{name: chat, path: {chat}, format: chat}}]"
    cfg = make_cfg("data.kind=grain", sources, "train.task=sft")
    assert data_tokenizer(cfg.data) == DEFAULT_TOKENIZER
    assert data_tokenizer_path(cfg) == str(DEFAULT_TOKENIZER)
    own = tmp_path / "own.model"
    cfg = make_cfg("data.kind=grain", sources, "train.task=sft", f"data.tokenizer={own}")
    assert data_tokenizer(cfg.data) == own
    assert data_tokenizer_path(cfg) == str(own)
