"""Hugging Face checkpoints in and out, with transformers as the oracle.

The fixtures in tests/fixtures/hf/ are small random transformers models, the token ids they were
run on and transformers' float32 logits (tools/make_hf_fixtures.py). Every family and
option we support is imported and run by our model here, with no torch needed. The last test
regenerates the fixtures and checks that our exports load back into transformers with the same
logits; it needs a Python with torch and transformers (MAXTRAIN_HF_PYTHON).
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
import yaml
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from support import REPO

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.config import ComputeConfig, MlaConfig, ModelConfig, MoeConfig
from maxtrain.hf import ConversionError, cli, read_hf_model, write_hf_model
from maxtrain.hf import convert as convert_lib
from maxtrain.hf import families as families_lib
from maxtrain.hf.config_map import hf_config, model_config
from maxtrain.hf.families import FAMILIES, family_for
from maxtrain.hf.layout import slots
from maxtrain.hf.tokenizer_files import run_tokenizer
from maxtrain.surgery import upcycle
from maxtrain.tokenizers import DEFAULT_TOKENIZER, load_tokenizer

FIXTURES = REPO / "tests" / "fixtures" / "hf"
MAKE_FIXTURES = REPO / "tools" / "make_hf_fixtures.py"
# The committed fixtures (the regeneration test below checks the generator makes the same set).
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
TOLERANCE = 1e-4  # max |logits difference| in float32
# Per family, the first fixture that exports as that family again (a Mistral without a window
# is a Llama to export), written with the run's tokenizer.
FAMILY_CASES: dict[str, str] = {}
for _case in CASES:
    _hf = json.loads((FIXTURES / _case / "config.json").read_text())
    _model = model_config(_hf, FAMILIES[_hf["model_type"]], _case)
    if family_for(_model).model_type == _hf["model_type"]:
        FAMILY_CASES.setdefault(_hf["model_type"], _case)


@functools.cache
def committed(case: str) -> tuple[ModelConfig, dict]:
    """read_hf_model of a committed fixture, read once for the tests that only read what it
    returns (the logits and the export of each case, the refusals)."""
    return read_hf_model(FIXTURES / case)


def logits(cfg: ModelConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    """Our model's float32 logits for tokens [B, T], one document per row."""
    spec = model_lib.ModelSpec(cfg, ComputeConfig(compute_dtype="float32"))
    graphdef, state = nnx.split(model_lib.abstract(spec))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params))
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit
    def apply(state, tokens):
        return nnx.merge(graphdef, state)(tokens, positions, jnp.ones((b, t), jnp.int32))[0]

    return np.asarray(apply(state, jnp.asarray(tokens)))


def abstract_params(cfg: ModelConfig) -> dict:
    return nnx.to_pure_dict(nnx.state(model_lib.abstract(model_lib.ModelSpec(cfg)), nnx.Param))


def changed(cfg: ModelConfig, **update) -> ModelConfig:
    """cfg with `update`'s keys, validated as a config file's would be."""
    return ModelConfig.model_validate({**cfg.model_dump(), **update})


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.max(np.abs(a.astype(np.float32) - b.astype(np.float32))))


def hf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def assert_same_tensors(exported: Path, original: Path) -> None:
    """Same tensor names, dtypes and values, however the files are sharded."""
    ours, theirs = hf_tensors(exported), hf_tensors(original)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)


def explicit_head_dim(cfg: ModelConfig) -> ModelConfig:
    """cfg as export writes it: head_dim always explicit (transformers 4 reads no null); with
    multi-head latent attention, model.mla holds the head sizes and head_dim stays unset."""
    if cfg.mla is not None:
        return cfg
    return cfg.model_copy(update={"head_dim": cfg.resolved_head_dim})


def assert_trees_equal(a: dict, b: dict) -> None:
    flat_a, flat_b = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (a, b))
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# ---- import: our logits against transformers' on the committed fixtures --------------------


def test_fixtures_cover_every_family_and_option():
    configs = [json.loads((FIXTURES / c / "config.json").read_text()) for c in CASES]
    assert {c["model_type"] for c in configs} == set(FAMILIES)
    assert {c.get("tie_word_embeddings") for c in configs} == {True, False}
    assert {"rope_scaling" in c for c in configs} == {True, False}  # both layouts
    # Small enough to commit: 400 KiB a case at most (the MoE + MLA + indexer cases are the
    # largest, 350 KB), 6 MiB in all.
    sizes = {
        c: sum(f.stat().st_size for f in (FIXTURES / c).rglob("*") if f.is_file()) for c in CASES
    }
    assert max(sizes.values()) < 400 * 2**10, sizes
    assert sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file()) < 6 * 2**20


def test_a_family_is_its_module_and_a_fixture():
    """Adding a family is adding its module to maxtrain/hf/families/ and its fixture
    (tools/make_hf_fixtures.py), nothing else: the registry holds exactly the package's
    modules, one family each, each with a committed fixture and an export rank of its own, none
    restating a schema default; the shared modules of maxtrain/hf/ name no family."""
    modules = sorted(info.name for info in pkgutil.iter_modules(families_lib.__path__))
    entries = [importlib.import_module(f"{families_lib.__name__}.{m}").FAMILY for m in modules]
    assert list(FAMILIES.values()) == entries
    assert sorted(FAMILY_CASES) == sorted(FAMILIES)
    assert len({family.rank for family in entries}) == len(entries)
    sections = {"": ModelConfig, "moe": MoeConfig, "rope": config_lib.RopeConfig, "mla": MlaConfig}
    for family in entries:
        for key, value in family.fixed.items():
            section, _, name = key.rpartition(".")
            assert value != sections[section].model_fields[name].default, (family, key)
    shared = (REPO / "maxtrain" / "hf").glob("*.py")
    named = {
        (path.name, node.value)
        for path in shared
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in FAMILIES
    }
    assert named == set()


@pytest.mark.parametrize("case", CASES)
def test_imported_logits_match_transformers(case):
    cfg, params = committed(case)
    tokens = np.load(FIXTURES / case / "tokens.npy")
    diff = max_diff(logits(cfg, params, tokens), np.load(FIXTURES / case / "logits.npy"))
    assert diff <= TOLERANCE, f"{case}: max |logits diff| {diff:.2e}"


# ---- export: the round trip inside our code -----------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_export_reproduces_the_original_files(case, tmp_path):
    """Export writes exactly the tensors transformers saved (names, dtype, values, sharded or
    not), and a config that imports as the same model."""
    cfg, params = committed(case)
    stored = next(iter(hf_tensors(FIXTURES / case).values())).dtype.name
    write_hf_model(cfg, params, tmp_path / "out", dtype=stored, max_shard_bytes=30_000)
    assert_same_tensors(tmp_path / "out", FIXTURES / case)
    again, params_again = read_hf_model(tmp_path / "out")
    assert again == explicit_head_dim(cfg)
    assert_trees_equal(params_again, params)


@pytest.mark.parametrize(
    "preset",
    [
        "llama3.2-1b",
        "mistral-7b",
        "qwen3-0.6b",
        "kanana-nano-2.1b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "deepseek-v3-671b",
        "deepseek-v3.2-671b",
        "glm-5",
        "kimi-k2-1t",
        "tiny-mla",
        "glm-4.5",
        "glm-4.5-air",
        "gemma3-1b",
        "gemma3-27b",
        "llama4-scout-17b-16e",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "qwen3-next-80b-a3b",
        "qwen3.5-9b",
        "qwen3.5-35b-a3b",
        "kimi-linear-48b-a3b",
    ],
)
def test_preset_configs_round_trip(preset):
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [f"model_name={preset}"]).model
    family = family_for(cfg)
    hf = hf_config(cfg, family, "bfloat16", 0.02)
    assert model_config(hf, family, "config.json") == explicit_head_dim(cfg)


# meta-llama/Llama-4-Scout-17B-16E's config.json: its text_config's keys that shape the model,
# as published (no_rope_layers empty: every 4th layer NoPE by no_rope_layer_interval's default).
SCOUT_TEXT_CONFIG = {
    "model_type": "llama4_text",
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": 4,
    "floor_scale": 8192,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "interleave_moe_layer_step": 1,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760,
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 202048,
}


@pytest.mark.parametrize("explicit", [False, True], ids=["published", "lists_spelled_out"])
def test_llama4_scout_config_imports_as_the_preset(explicit):
    """The published config.json, and the same with the per-layer lists transformers 5 writes
    (no_rope_layers, layer_types, moe_layers), are the preset llama4-scout-17b-16e."""
    hf = dict(SCOUT_TEXT_CONFIG)
    if explicit:
        rope = [int((i + 1) % 4 != 0) for i in range(48)]
        hf["no_rope_layers"] = rope
        hf["layer_types"] = ["chunked_attention" if r else "full_attention" for r in rope]
        hf["moe_layers"] = list(range(48))
    preset = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", ["model_name=llama4-scout-17b-16e"]
    ).model
    assert model_config(hf, FAMILIES["llama4_text"], "config.json") == preset


def llama4_test_config(**changes) -> ModelConfig:
    """A small Llama-4-shaped model: chunked RoPE layers, a NoPE layer, MoE every 2nd layer."""
    fields = dict(
        vocab_size=16,
        emb_dim=8,
        num_layers=5,
        num_heads=2,
        num_kv_heads=1,
        mlp_dim=12,
        rope=dict(interleaved=True),
        qk_norm="rms_unscaled",
        layers=["chunked-dense", "chunked-moe", "chunked-dense", "nope-moe"],
        attention_chunk=4,
        attention_temperature=dict(floor=4),
        moe=dict(
            num_experts=3,
            top_k=2,
            expert_mlp_dim=4,
            shared_experts=1,
            score="sigmoid",
            renormalize=False,
            weight_on="input",
        ),
    )
    return ModelConfig.model_validate({**fields, **changes})


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(
            vocab_size=16,
            emb_dim=8,
            num_layers=5,
            num_heads=2,
            num_kv_heads=1,
            mlp_dim=12,
            qk_norm="rms",
            layers=["global-dense", "global-moe"],
            moe=MoeConfig(num_experts=3, top_k=2, expert_mlp_dim=4),
        ),
        llama4_test_config(),  # experts stacked, a fused gate_up_proj
        ModelConfig(  # experts fused, gate and up interleaved, with biases; sinks
            vocab_size=16,
            emb_dim=8,
            num_layers=3,
            num_heads=2,
            num_kv_heads=1,
            attention_projection_bias="qkvo",
            attention_sinks=True,
            layers=["sliding-moe", "global-moe"],
            sliding_window=4,
            moe=MoeConfig(
                num_experts=3,
                top_k=2,
                expert_mlp_dim=4,
                router_logit_bias=True,
                expert_projection_bias=True,
                clamped_swiglu={"limit": 7.0},
            ),
        ),
    ],
    ids=["per_expert", "llama4_stacked_experts", "gpt_oss_fused_experts"],
)
def test_slots_cover_every_parameter_once(cfg):
    counts = jax.tree.map(lambda a: np.zeros(a.shape, int), abstract_params(cfg))
    for slot in slots(cfg, family_for(cfg)):
        node = counts
        for key in slot.path:
            node = node[key]
        node[slot.index] += 1
    assert all(np.all(c == 1) for c in jax.tree.leaves(counts))


@pytest.mark.parametrize("q_lora_rank", [None, 6])
def test_mla_slots_cover_every_parameter_once(q_lora_rank):
    cfg = ModelConfig(
        vocab_size=16,
        emb_dim=8,
        num_layers=3,
        num_heads=2,
        mlp_dim=12,
        mla=MlaConfig(
            q_lora_rank=q_lora_rank,
            kv_lora_rank=4,
            qk_nope_head_dim=4,
            qk_rope_head_dim=2,
            v_head_dim=3,
        ),
        moe=MoeConfig(
            num_experts=3,
            top_k=2,
            expert_mlp_dim=4,
            shared_experts=1,
            score="sigmoid",
            balance_bias_update_rate=0.001,
        ),
        layers=["global-dense", "global-moe*2"],
    )
    counts = jax.tree.map(lambda a: np.zeros(a.shape, int), abstract_params(cfg))
    for slot in slots(cfg, family_for(cfg)):
        node = counts
        for key in slot.path:
            node = node[key]
        node[slot.index] += 1
    assert all(np.all(c == 1) for c in jax.tree.leaves(counts))


def test_multi_token_prediction_layers_past_the_decoder_are_skipped(tmp_path):
    """GLM-4.5's checkpoints hold a multi-token prediction layer after the decoder's
    (model.layers.92 of 92 layers), which transformers does not load: import skips it, and
    the export says it holds none."""
    case = "glm4_moe_qk_norm_quarter_rope_v5"
    model_dir = Path(shutil.copytree(FIXTURES / case, tmp_path / "in"))
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    mtp = {
        f"model.layers.{layers}.{name}": np.ones(shape, np.float32)
        for name, shape in [("eh_proj.weight", (32, 64)), ("enorm.weight", (32,))]
    }
    edit_tensors(model_dir, lambda t: t.update(mtp))
    cfg, params = read_hf_model(model_dir)
    assert cfg.mtp.depth == 0
    assert_trees_equal(params, committed(case)[1])
    write_hf_model(cfg, params, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == 0


def test_partial_rope_defaults_to_half_for_glm_only(tmp_path):
    """A glm4_moe config.json without partial_rotary_factor rotates half of each head, as
    transformers' Glm4MoeConfig assumes; another family's partial RoPE is refused."""
    hf = json.loads((FIXTURES / "glm4_moe_air_grouped_legacy" / "config.json").read_text())
    del hf["partial_rotary_factor"]
    assert model_config(hf, FAMILIES["glm4_moe"], "config.json").rope.fraction == 0.5
    llama = json.loads((FIXTURES / "llama_gqa_untied_sharded" / "config.json").read_text())
    with pytest.raises(ConversionError, match="partial_rotary_factor=0.5 is not supported for"):
        model_config({**llama, "partial_rotary_factor": 0.5}, FAMILIES["llama"], "config.json")


def test_cli_import_trains_from_and_exports_back(tmp_path, capsys):
    """The tools' path: import writes a checkpoint that load_parameters reads (what
    checkpoint.load_parameters_path does) and a model file the config system accepts; export
    of that checkpoint writes the original tensors back."""
    case = FIXTURES / "qwen3_moe_top3_sparse_step_v5"
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert cli.main(["import", "--hf-dir", str(case), "--output", str(ckpt)]) == 0
    cfg, params = read_hf_model(case)

    model_file = yaml.safe_load((ckpt / convert_lib.MODEL_YAML).read_text())
    base = yaml.safe_load((config_lib.CONFIGS_DIR / "base.yml").read_text())
    run = config_lib.validate(config_lib.deep_merge(base, {"model": model_file}))
    assert run.model == cfg
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
        abstract_params(run.model),
    )
    assert_trees_equal(load_parameters(ckpt, abstract), params)

    assert cli.main(["export", "--checkpoint", str(ckpt), "--output", str(out)]) == 0
    assert "Qwen3MoeForCausalLM" in capsys.readouterr().out
    assert_same_tensors(out, case)


def test_import_and_export_do_not_depend_on_training_settings(tmp_path):
    """A context shorter than configs/base.yml's train.seq_len (128) is the model's business,
    not a reason to refuse the import (it was: "train.seq_len (128) exceeds model.max_seq_len")."""
    case = Path(shutil.copytree(FIXTURES / "llama_gqa_untied_sharded", tmp_path / "in"))
    edit_config(case, max_position_embeddings=64)
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert cli.main(["import", "--hf-dir", str(case), "--output", str(ckpt)]) == 0
    assert yaml.safe_load((ckpt / convert_lib.MODEL_YAML).read_text())["max_seq_len"] == 64
    assert cli.main(["export", "--checkpoint", str(ckpt), "--output", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 64


def test_export_writes_the_tokenizer_its_ids_and_the_step(tmp_path, capsys):
    """What a Hugging Face user needs next: the run's sentencepiece model (found from the
    config saved with the checkpoint, or given), its bos/eos ids in config.json and
    generation_config.json; the message names the step exported."""
    case = FIXTURES / "llama_gqa_untied_sharded"
    ckpt = tmp_path / "ckpt"
    assert cli.main(["import", "--hf-dir", str(case), "--output", str(ckpt)]) == 0
    capsys.readouterr()
    # An imported checkpoint's saved config has no data section: its tokenizer is not known.
    assert cli.main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "a")]) == 0
    assert "from step 0" in (printed := capsys.readouterr().out) and "--tokenizer" in printed
    assert not (tmp_path / "a" / "tokenizer.model").exists()

    args = ["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "b")]
    assert cli.main([*args, "--tokenizer", str(DEFAULT_TOKENIZER)]) == 0
    assert f"tokenizer {DEFAULT_TOKENIZER}" in capsys.readouterr().out
    out = tmp_path / "b"
    assert (out / "tokenizer.model").read_bytes() == DEFAULT_TOKENIZER.read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(DEFAULT_TOKENIZER))
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == sp.eos_id()
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == sp.id_to_piece(sp.eos_id())

    # A run on the embedded corpus: its saved config says which tokenizer it used.
    run_cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", ["model_name=tiny"])
    assert run_tokenizer(config_lib.to_yaml(run_cfg)) == DEFAULT_TOKENIZER
    synthetic = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", ["model_name=tiny", "data.kind=synthetic"]
    )
    assert run_tokenizer(config_lib.to_yaml(synthetic)) is None


def test_tool_script_runs(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "convert_hf.py"),
            "import",
            "--hf-dir",
            str(FIXTURES / "llama3_mqa_tied_rope_scaling"),
            "--output",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "load_parameters_path" in result.stdout


# ---- bad input: one line, exit 2, nothing left behind --------------------------------------


def edit_config(model_dir: Path, **changes) -> Path:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return model_dir


def edit_tensors(model_dir: Path, change) -> Path:
    """Applies change(tensors) to a single-file fixture's model.safetensors."""
    tensors = hf_tensors(model_dir)
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def no_config(d: Path) -> Path:
    (d / "config.json").unlink()
    return d


def index_points_elsewhere(d: Path) -> Path:
    """The index names a shard that does not hold the tensor."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    weight_map["model.norm.weight"] = weight_map["model.embed_tokens.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


# problem -> (case, how to break it, what the one line must say)
BAD_IMPORTS = {
    "no config.json": ("llama_gqa_untied_sharded", no_config, "no config.json"),
    "unknown model_type": (
        "llama_gqa_untied_sharded",
        lambda d: edit_config(d, model_type="gpt2"),
        "model_type 'gpt2' is not supported",
    ),
    "missing tensor": (
        "qwen3_gqa4_untied_v5",
        lambda d: edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "model.safetensors: no tensor 'model.layers.1.mlp.up_proj.weight'",
    ),
    "shard without a listed tensor": (
        "llama_gqa_untied_sharded",
        index_points_elsewhere,
        "no tensor 'model.norm.weight' (model.safetensors.index.json lists it)",
    ),
    "shape mismatch": (
        "llama_gqa_untied_sharded",
        lambda d: edit_config(d, intermediate_size=48),
        "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 32]; config.json "
        "(llama) implies [48, 32]",
    ),
    "unexplained tensor (a bias)": (
        "qwen3_gqa4_untied_v5",
        lambda d: edit_tensors(
            d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64)})
        ),
        "tensor 'model.layers.0.self_attn.q_proj.bias' has no place in a qwen3 model",
    ),
    "unsupported RoPE": (
        "llama3_mqa_tied_rope_scaling",
        lambda d: edit_config(d, rope_scaling={"rope_type": "longrope", "factor": 4.0}),
        "RoPE type 'longrope' is not supported",
    ),
    "unsupported option": (
        "llama_gqa_untied_sharded",
        lambda d: edit_config(d, attention_bias=True),
        "attention_bias=true is not supported",
    ),
    "quantized": (
        "mixtral_top2_v5",
        lambda d: edit_config(d, quantization_config={"quant_method": "fp8"}),
        "quantized checkpoints are not supported",
    ),
    "llama4 layer_types not by RoPE": (
        "llama4_chunked_nope_moe_v5",
        lambda d: edit_config(d, layer_types=["full_attention"] * 5),
        "layer_types ['full_attention', 'full_attention', 'full_attention', 'full_attention', "
        "'full_attention'] is not supported",
    ),
    "llama4 without a chunk": (
        "llama4_chunked_nope_moe_v5",
        lambda d: edit_config(d, attention_chunk_size=None),
        "attention_chunk_size is null; chunked layers need it",
    ),
    "logit soft-capping (Gemma 2's, unmodelled)": (
        "gemma3_window4_linear_rope_v5",
        lambda d: edit_config(d, final_logit_softcapping=30.0),
        "final_logit_softcapping=30.0 is not supported",
    ),
    "a layer type we do not model": (
        "gemma3_window4_linear_rope_v5",
        lambda d: edit_config(d, layer_types=["chunked_attention"] * 5 + ["full_attention"]),
        "layer_types holds 'chunked_attention'",
    ),
    "scaled RoPE on the sliding layers": (
        "gemma3_window4_linear_rope_v5",
        lambda d: edit_config(
            d,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0},
            },
        ),
        "sliding_attention RoPE type 'linear' is not supported",
    ),
    "linear RoPE where no fixture checks it": (
        "llama3_mqa_tied_rope_scaling",
        lambda d: edit_config(d, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "RoPE type 'linear' is supported for gemma3_text only, not llama",
    ),
    "MXFP4 (GPT-OSS on the hub)": (
        "gpt_oss_window_sinks_yarn_v5",
        lambda d: edit_config(d, quantization_config={"quant_method": "mxfp4"}),
        "quantized checkpoints are not supported; dequantize it first: transformers' "
        "from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))",
    ),
    "a Qwen3-Next shared expert no multiple of an expert": (
        "qwen3_next_hybrid_moe_v5",
        lambda d: edit_config(d, shared_expert_intermediate_size=12),
        "shared_expert_intermediate_size=12 is not supported (only a positive multiple of "
        "moe_intermediate_size=8)",
    ),
    "a Qwen3-Next layer type we do not model": (
        "qwen3_next_hybrid_moe_v5",
        lambda d: edit_config(d, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        "layer_types holds 'sliding_attention'; supported: linear_attention, full_attention",
    ),
    "a GLM-5 layer sharing the previous layer's top-k": (
        "glm_moe_dsa_indexer_top4_v5",
        lambda d: edit_config(d, indexer_types=["full", "shared", "full"]),
        "layers [1] reuse the previous layer's top-k (indexer_types 'shared'): not supported",
    ),
    "layer_types of another length": (
        "gpt_oss_window_sinks_yarn_v5",
        lambda d: edit_config(d, layer_types=["sliding_attention", "full_attention"]),
        "layer_types names 2 layers, num_hidden_layers is 3",
    ),
}


@pytest.mark.parametrize("problem", BAD_IMPORTS)
def test_bad_import_is_one_line_exit_2_nothing_written(problem, tmp_path, capsys):
    case, breaks, expected = BAD_IMPORTS[problem]
    model_dir = breaks(Path(shutil.copytree(FIXTURES / case, tmp_path / "in")))
    output = tmp_path / "out" / "ckpt"
    output.parent.mkdir()
    assert cli.main(["import", "--hf-dir", str(model_dir), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert_hf: error: "), err
    assert expected in err
    assert list(output.parent.iterdir()) == []


def test_existing_output_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    args = ["import", "--hf-dir", str(FIXTURES / "mixtral_top2_v5"), "--output"]
    assert cli.main([*args, str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    args = ["export", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "hf")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no complete checkpoint found" in err
    assert not (tmp_path / "hf").exists()


def test_failed_export_leaves_no_directory(tmp_path, monkeypatch):
    cfg, params = committed("mixtral_top2_v5")

    def fail_midway(directory, tensors, max_shard_bytes):
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(convert_lib, "write_safetensors", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        write_hf_model(cfg, params, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "case, change, moe_layers",
    [
        # Qwen3-MoE: every decoder_sparse_step-th layer, less those mlp_only_layers lists
        ("qwen3_moe_top3_sparse_step_v5", dict(mlp_only_layers=[3]), [1, 5]),
        # Llama 4: moe_layers lists them
        ("llama4_chunked_nope_moe_v5", dict(moe_layers=[0, 3, 4]), [0, 3, 4]),
        # DeepSeek-V3: all after the first_k_dense_replace first
        ("deepseek_v3_grouped", dict(first_k_dense_replace=2), [2]),
    ],
)
def test_every_hugging_face_layout_of_moe_layers_reads_and_writes_back(case, change, moe_layers):
    """Whichever layers a config.json makes mixtures of experts, model.layers says, and the
    export writes the config.json keys that make the same ones."""
    hf = {**json.loads((FIXTURES / case / "config.json").read_text()), **change}
    family = FAMILIES[hf["model_type"]]
    cfg = model_config(hf, family, "config.json")
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == moe_layers
    again = model_config(hf_config(cfg, family, "float32", 0.02), family, "config.json")
    assert again == explicit_head_dim(cfg)


def test_a_gpt_oss_config_reads_as_transformers_fills_it_in():
    """What config.json leaves out, transformers' GptOssConfig fills in: layer_types
    alternating sliding and full from layer 0, sliding_window 128, YaRN (factor 32 over 4096,
    untruncated), the clamp's alpha 1.702 and limit 7.0, biases."""
    hf = json.loads((FIXTURES / "gpt_oss_window_sinks_yarn_v5" / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "rope_parameters", "swiglu_alpha"):
        hf.pop(key)
    hf.pop("swiglu_limit")
    cfg = model_config(hf, FAMILIES["gpt_oss"], "config.json")
    assert cfg.layers == ["sliding-moe", "global-moe"] and cfg.sliding_window == 128
    assert cfg.rope.theta == 150000.0
    assert cfg.rope.scaling == config_lib.RopeScaling(
        type="yarn", factor=32.0, original_max_position=4096, truncate=False
    )
    assert cfg.moe.clamped_swiglu == config_lib.ClampedSwiglu(alpha=1.702, limit=7.0)
    assert cfg.attention_projection_bias == "qkvo" and cfg.attention_sinks
    assert cfg.moe.router_logit_bias and cfg.moe.expert_projection_bias and cfg.moe.renormalize
    # transformers builds no sliding mask without a window (it raises): neither do we
    with pytest.raises(ConversionError, match="sliding layers but sliding_window is null"):
        model_config({**hf, "sliding_window": None}, FAMILIES["gpt_oss"], "config.json")


QWEN3_NEXT_CASE = FIXTURES / "qwen3_next_hybrid_moe_v5"


def test_a_qwen3_next_config_reads_as_transformers_fills_it_in():
    """Without layer_types every full_attention_interval-th layer is full attention (4th when
    absent), as Qwen3NextConfig derives it; partial RoPE is 0.25 when rope_parameters do not
    say; all layers full attention is a model without linear layers."""
    hf = json.loads((QWEN3_NEXT_CASE / "config.json").read_text())
    hf.pop("layer_types"), hf.pop("rope_parameters")
    family = FAMILIES["qwen3_next"]
    cfg = model_config(hf, family, "config.json")
    assert cfg.layers == ["linear-dense", "linear-moe*2", "global-moe"]  # mlp_only_layers [0]
    assert cfg.rope.fraction == 0.25 and cfg.rope.theta == 10000.0
    assert cfg.norm_scale_plus_one and cfg.qk_norm == "rms" and cfg.attention_output_gate
    assert (cfg.moe.shared_experts, cfg.moe.shared_expert_gate) == (2, True)
    cfg = model_config({**hf, "full_attention_interval": 2}, family, "config.json")
    assert cfg.layers == ["linear-dense", "global-moe", "linear-moe", "global-moe"]
    cfg = model_config({**hf, "full_attention_interval": 1}, family, "config.json")
    assert cfg.layers == ["global-dense", "global-moe*3"] and cfg.linear_attention is None


def test_qwen3_next_logits_do_not_depend_on_our_chunk():
    """model.linear_attention.chunk is how we compute the recurrence, not the checkpoint's:
    the fixture's 12 tokens in chunks of 4 (state carried between three chunks) give
    transformers' logits as one chunk of 64 does."""
    cfg, params = committed(QWEN3_NEXT_CASE.name)
    assert cfg.linear_attention.chunk == 64
    cfg = cfg.model_copy(
        update={"linear_attention": cfg.linear_attention.model_copy(update={"chunk": 4})}
    )
    tokens = np.load(QWEN3_NEXT_CASE / "tokens.npy")
    diff = max_diff(logits(cfg, params, tokens), np.load(QWEN3_NEXT_CASE / "logits.npy"))
    assert diff <= TOLERANCE


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(attention_output_gate=False), "model.attention_output_gate=false"),
        (dict(norm_scale_plus_one=False), "model.norm_scale_plus_one=false"),
        (dict(moe=dict(shared_expert_gate=False)), "model.moe.shared_expert_gate=false"),
        (dict(moe=dict(shared_experts=0, shared_expert_gate=False)), "shared_experts=0"),
        (
            dict(linear_attention=dict(num_key_heads=2, num_value_heads=4, channel_decay=True)),
            "model.linear_attention.channel_decay=true",
        ),
        (
            dict(layers=["linear-dense", "sliding-moe"], sliding_window=4),
            "model.layers' sliding",
        ),
    ],
)
def test_what_qwen3_next_cannot_express_is_refused(change, expected):
    cfg, _ = committed(QWEN3_NEXT_CASE.name)
    moe = {**cfg.moe.model_dump(), **change.pop("moe", {})}
    cfg = changed(cfg, moe=moe, **change)
    with pytest.raises(ConversionError, match="cannot export as Qwen3NextForCausalLM") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(attention_sinks=False), "cannot export as MixtralForCausalLM"),  # no longer GPT-OSS
        (dict(moe=dict(clamped_swiglu=None)), "model.moe.clamped_swiglu=null"),
        (dict(moe=dict(expert_projection_bias=False)), "moe.expert_projection_bias=false"),
        (dict(attention_projection_bias="qkv"), "model.attention_projection_bias=qkv"),
        (dict(rope=dict(theta=150000.0, local_theta=10.0)), "model.rope.local_theta=10.0"),
    ],
)
def test_what_gpt_oss_cannot_express_is_refused(change, expected):
    cfg, _ = committed("gpt_oss_window_sinks_yarn_v5")
    moe = {**cfg.moe.model_dump(), **change.pop("moe", {})}
    cfg = changed(cfg, moe=moe, **change)
    with pytest.raises(ConversionError, match="cannot export as") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


@pytest.mark.parametrize(
    "moe, expected",
    [
        (dict(shared_experts=1), "model.moe.shared_experts=1"),
        (dict(renormalize=False), "model.moe.renormalize=false"),  # Mixtral always renormalises
        (dict(layers=["global-dense", "global-moe"], mlp_dim=32), "dense layers beside MoE"),
    ],
)
def test_unexportable_models_are_refused(moe, expected):
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", ["model_name=tiny-moe", "model.num_layers=3"]
    ).model
    layout = {key: moe.pop(key) for key in ("layers", "mlp_dim") if key in moe}
    cfg = changed(cfg, moe={**cfg.moe.model_dump(), **moe}, **layout)
    with pytest.raises(ConversionError, match="cannot export as MixtralForCausalLM") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


GLM = ["model.moe.score=sigmoid", "model.moe.balance_bias_update_rate=0.001"]  # as GLM-4.5
QKVO = "model.attention_projection_bias=qkvo"


@pytest.mark.parametrize(
    "overrides, family, expected",
    [
        # GLM-4.5 has no o_proj bias, and its router always has the correction bias.
        ([*GLM, QKVO], "Glm4MoeForCausalLM", QKVO),
        (GLM[:1], "Glm4MoeForCausalLM", "model.moe.balance_bias_update_rate=0.0"),
        # Only GLM-4.5 rotates part of a head or has attention biases.
        (["model.rope.fraction=0.5"], "MixtralForCausalLM", "model.rope.fraction=0.5"),
        (["model.attention_projection_bias=qkv"], "MixtralForCausalLM", "bias=qkv"),
    ],
)
def test_what_a_family_cannot_express_is_refused(overrides, family, expected):
    tiny_moe = ["model_name=tiny-moe", "model.num_layers=3"]
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [*tiny_moe, *overrides]).model
    with pytest.raises(ConversionError, match=f"cannot export as {family}") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(qk_norm="rms"), "model.qk_norm=rms (its qk-norm has no scale)"),
        (dict(layers=["sliding-moe"], sliding_window=4, attention_chunk=None,
              attention_temperature=None, mlp_dim=None), "model.layers' sliding layers"),
        (dict(layers=["chunked-dense", "chunked-moe", "chunked-dense", "global-moe"],
              attention_temperature=None), "model.layers' global layers"),  # RoPE on them
        (dict(rope=dict(interleaved=False)), "model.rope.interleaved=false"),
    ],
)  # fmt: skip
def test_unexportable_llama4_models_are_refused(changes, expected):
    cfg = llama4_test_config(**changes)
    with pytest.raises(ConversionError, match="cannot export as Llama4ForCausalLM") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


@pytest.mark.parametrize(
    "overrides, family, expected",
    [
        (["model.layers=[sliding-dense, global-dense]", "model.sliding_window=4"],
         "MistralForCausalLM", "model.layers=['sliding-dense', 'global-dense'] (global layers"),
        (["model.layers=[chunked-dense]", "model.attention_chunk=4"],
         "MistralForCausalLM", "model.attention_chunk=4"),
        (["model.layers=[sliding-dense]", "model.sliding_window=4",
          "model.rope.local_theta=500.0"],
         "MistralForCausalLM", "model.rope.local_theta=500.0"),
        (["model_name=tiny-qk", "model.layers=[sliding-dense]", "model.sliding_window=4"],
         "Qwen3ForCausalLM", "model.layers' sliding layers"),
    ],
)  # fmt: skip
def test_unexportable_attention_patterns_are_refused(make_cfg, overrides, family, expected):
    """Mistral writes one sliding window for every layer; what else model.layers says (global
    layers among sliding ones, chunks, a RoPE base of their own), or sliding layers in a
    family without a window, would be dropped from the export: refused, naming the key."""
    cfg = make_cfg(*overrides).model
    with pytest.raises(ConversionError, match=f"cannot export as {family}") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


def test_what_only_llama4_expresses_is_refused_elsewhere():
    plain = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", ["model_name=tiny-qk"]).model
    for changes, expected in [
        (dict(qk_norm="rms_unscaled"), "model.qk_norm=rms_unscaled"),
        (dict(layers=["nope-dense", "global-dense"]), "model.layers' nope layers"),
    ]:
        cfg = changed(plain, **changes)
        with pytest.raises(ConversionError, match=expected):
            hf_config(cfg, family_for(cfg), "float32", 0.02)


LINEAR = dict(rope=dict(theta=500000.0, scaling=dict(type="linear", factor=8.0)))


@pytest.mark.parametrize(
    "preset, update, architecture, expected",
    [
        ("gemma3-1b", dict(mlp_activation="silu"), "Gemma3", "model.mlp_activation=silu"),
        ("gemma3-1b", dict(norm_scale_plus_one=False), "Gemma3", "model.norm_scale_plus_one"),
        (
            "gemma3-1b",
            dict(layers=["chunked-dense*5", "global-dense"], sliding_window=None,
                 attention_chunk=8),
            "Gemma3",
            "model.layers' chunked layers",
        ),
        (
            "gemma3-1b",
            LINEAR,  # without its own base, the sliding layers would take the scaling
            "Gemma3",
            "model.rope.local_theta=null with model.rope.scaling",
        ),
        ("llama3.2-1b", dict(softmax_scale_dim=96), "Llama", "model.softmax_scale_dim=96"),
        ("llama3.2-1b", dict(scale_embeddings=True), "Llama", "model.scale_embeddings=true"),
        (
            "llama3.2-1b",
            dict(layers=["sliding-dense", "global-dense"], sliding_window=8),
            "Mistral",
            "(global layers beside sliding ones)",
        ),
        ("llama3.2-1b", LINEAR, "Llama", "model.rope.scaling.type=linear"),
    ],
)  # fmt: skip
def test_gemma_3_options_export_only_as_gemma_3(preset, update, architecture, expected):
    """Export writes a family's config.json only for a model it computes: Gemma 3's fixed
    features, a window (not a chunk) with an unscaled local RoPE; none of them elsewhere."""
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [f"model_name={preset}"]).model
    cfg = changed(cfg, **update)
    with pytest.raises(ConversionError, match=f"cannot export as {architecture}") as e:
        hf_config(cfg, family_for(cfg), "float32", 0.02)
    assert expected in str(e.value)


# ---- transformers as the oracle (needs torch + transformers) ------------------------------


def hf_python(*modules: str) -> str:
    """A Python with `modules` (torch and transformers unless named): MAXTRAIN_HF_PYTHON, else
    this one. maxtrain needs Python >= 3.12, for which this machine has no CPU torch, so the two
    usually differ; transformers alone (its tokenizers) needs no torch. The probe finds the
    modules without importing them (seconds of CPU for transformers): the test imports them."""
    modules = modules or ("torch", "transformers")
    python = os.environ.get("MAXTRAIN_HF_PYTHON", sys.executable)
    find = f"import importlib.util as u; exit(any(u.find_spec(m) is None for m in {modules}))"
    probe = subprocess.run([python, "-c", find], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            f"needs {' + '.join(modules)}: set MAXTRAIN_HF_PYTHON (tools/make_hf_fixtures.py)"
        )
    return python


TEXTS = ["The", "Q: What is 12 + 34?\nA:", " two  spaces", "def main(\n    x\t1", "é 中"]
# Text spelling the tokenizer's special pieces, alone and amid text (web and code data carry
# them): maxtrain encodes it as text, and so must transformers from the export.
SPECIAL_TEXTS = ["<s>", "</s>", "<unk>", "<pad>", "<s> and </s> literally"]
SPECIAL_TEXTS += [
    "a<s>b", "</s>\n", " <unk> ", "<<s>>", "<s><s></s>", "x = '</s>'", "print(\"<unk>\")",
    "<pad><pad>", "The end.</s>", "<s>Q: What is 12 + 34?\nA:", "html: <s>strike</s>",
    "</s></s>", "<unk>é 中", "\t<s>\t", "<s >", "< /s>", "<S>", "token <pad> here",
    "<|im_start|>user\nhi<|im_end|>", "1 <s> 2 </s> 3 <unk> 4 <pad> 5",
]  # fmt: skip

# transformers' AutoTokenizer ignores tokenizer_config.json's class for some model types (its
# MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, meant for the hub's Qwen3.5-MoE repositories) and
# loads its own, which splits text before the vocabulary does: an export of such a family is
# read with the class its tokenizer_config.json names (docs/huggingface.md says so).
AUTO_TOKENIZER_OVERRIDES = {"qwen3_5_moe_text": "Qwen3_5Tokenizer"}

ENCODE_IN_TRANSFORMERS = """
import json, sys
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
texts, overridden, dirs = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
auto = {d: AutoTokenizer.from_pretrained(d) for d in dirs}
named = lambda d: json.load(open(d + "/tokenizer_config.json"))["tokenizer_class"]
tokenizers = {
    d: tokenizer_class_from_name(named(d)).from_pretrained(d) if d in overridden else auto[d]
    for d in dirs
}
encoded = {d: [tokenizer.encode(t) for t in texts] for d, tokenizer in tokenizers.items()}
print(json.dumps({"auto": {d: type(t).__name__ for d, t in auto.items()}, "encoded": encoded}))
"""


# The modules transformers needs to read an export's tokenizer.model beyond itself, where a
# family needs more. For Mistral, transformers 5 has no tokenizer class of its own without
# mistral-common: its generic backend reads the file through sentencepiece and protobuf
# (Llama's class converts it without).
MORE_TOKENIZER_MODULES = {"mistral": ("sentencepiece", "google.protobuf")}
TOKENIZER_READERS: dict[tuple[str, ...], list[str]] = {}
for _family in FAMILIES:
    _modules = ("transformers", *MORE_TOKENIZER_MODULES.get(_family, ()))
    TOKENIZER_READERS.setdefault(_modules, []).append(_family)


@pytest.mark.parametrize("modules", TOKENIZER_READERS, ids=lambda m: "+".join(m))
def test_transformers_encodes_an_exported_tokenizer_as_maxtrain_does(tmp_path, modules):
    """AutoTokenizer on an export encodes as maxtrain's sentencepiece tokenizer, for every
    family: the Llama export put a space piece before the text ("The": 673, not 435), as
    transformers' Llama tokenizer does unless told the model adds no space; and text spelling
    a special token ("<s> and </s> literally") became BOS and EOS ids in transformers, where
    sentencepiece, and so the trained model, reads its pieces."""
    assert sorted(sum(TOKENIZER_READERS.values(), [])) == sorted(FAMILIES)
    python = hf_python(*modules)
    families = TOKENIZER_READERS[modules]
    for family, case in ((f, FAMILY_CASES[f]) for f in families):
        ckpt, out = tmp_path / f"{family}-ckpt", tmp_path / family
        assert cli.main(["import", "--hf-dir", str(FIXTURES / case), "--output", str(ckpt)]) == 0
        export = ["export", "--checkpoint", str(ckpt), "--output", str(out)]
        assert cli.main([*export, "--tokenizer", str(DEFAULT_TOKENIZER)]) == 0
        assert json.loads((out / "config.json").read_text())["model_type"] == family
    texts = TEXTS + SPECIAL_TEXTS
    expected = load_tokenizer(DEFAULT_TOKENIZER).encode(texts)
    sp = spm.SentencePieceProcessor(model_file=str(DEFAULT_TOKENIZER))
    assert expected[0] == [sp.piece_to_id("The")]  # one piece, no space before it
    controls = {sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.pad_id()}
    assert not controls & {i for ids in expected for i in ids}  # special text is text
    dirs = [str(tmp_path / family) for family in families]
    overridden = [str(tmp_path / family) for family in AUTO_TOKENIZER_OVERRIDES]
    result = subprocess.run(
        [python, "-c", ENCODE_IN_TRANSFORMERS, json.dumps(texts), json.dumps(overridden), *dirs],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for directory in dirs:
        assert found["encoded"][directory] == expected, directory
    for family, auto_class in AUTO_TOKENIZER_OVERRIDES.items():
        if family in families:  # the override is still transformers': the docs still hold
            assert found["auto"][str(tmp_path / family)] == auto_class


def upcycled(
    case: str, moe: MoeConfig, layers: list[str] | None = None
) -> tuple[ModelConfig, dict]:
    """A fixture's dense model upcycled to `moe` on `layers` (None: every layer), with a random
    router and perturbed experts (so that routing decides the output)."""
    dense, params = read_hf_model(FIXTURES / case)
    mlp_dim = None if layers is None else dense.mlp_dim
    cfg = changed(dense, moe=moe.model_dump(), layers=layers, mlp_dim=mlp_dim)
    return cfg, upcycle(params, dense, cfg, noise_std=0.3, router_init_std=0.5, seed=1)


def gpt_oss_plain() -> tuple[ModelConfig, dict]:
    """The GPT-OSS fixture without what its family's config class would otherwise fill in:
    no sliding window (layer_types all full_attention), no attention biases, plain RoPE
    (transformers reads an absent or null rope_scaling as YaRN)."""
    cfg, params = read_hf_model(FIXTURES / "gpt_oss_window_sinks_yarn_v5")
    cfg = changed(
        cfg,
        layers=None,
        sliding_window=None,
        attention_projection_bias="none",
        rope={**cfg.rope.model_dump(), "scaling": None},
    )
    attn = params["moe_layers"]["attn"]
    for name in "qkvo":
        attn[name].pop("bias")
    return cfg, params


def test_transformers_loads_our_exports_with_the_same_logits(tmp_path):
    python = hf_python()
    regenerated = tmp_path / "fixtures"
    subprocess.run([python, str(MAKE_FIXTURES), "build", "--output", str(regenerated)], check=True)
    assert sorted(p.name for p in regenerated.iterdir() if p.is_dir()) == CASES
    models_out = {}
    for case in CASES:
        committed, fresh = FIXTURES / case, regenerated / case
        assert json.loads((fresh / "config.json").read_text()) == json.loads(
            (committed / "config.json").read_text()
        ), f"{case}: committed fixture is stale; rerun tools/make_hf_fixtures.py build"
        cfg, params = read_hf_model(fresh)
        tokens = np.load(fresh / "tokens.npy")
        ours = logits(cfg, params, tokens)
        assert max_diff(ours, np.load(fresh / "logits.npy")) <= TOLERANCE, case
        assert max_diff(np.load(committed / "logits.npy"), np.load(fresh / "logits.npy")) < 1e-6
        models_out[case] = (cfg, params, tokens, ours)
    tokens = np.load(FIXTURES / CASES[0] / "tokens.npy")
    for name, (cfg, params) in {
        "upcycled_llama_as_mixtral": upcycled(
            "llama_gqa_untied_sharded", MoeConfig(num_experts=4, top_k=2, expert_mlp_dim=32)
        ),
        "upcycled_qwen3_as_qwen3_moe": upcycled(
            "qwen3_gqa4_untied_v5",
            MoeConfig(num_experts=6, top_k=2, expert_mlp_dim=32, renormalize=False),
            layers=["global-dense", "global-moe"],  # the first layer dense
        ),
        "gpt_oss_plain": gpt_oss_plain(),
    }.items():
        models_out[name] = (cfg, params, tokens, logits(cfg, params, tokens))

    exported = tmp_path / "exported"
    exported.mkdir()
    for name, (cfg, params, tokens, _) in models_out.items():
        write_hf_model(cfg, params, exported / name, max_shard_bytes=50_000)
        np.save(exported / name / "tokens.npy", tokens)
    dirs = [str(exported / name) for name in models_out]
    subprocess.run([python, str(MAKE_FIXTURES), "logits", *dirs], check=True)
    for name, (*_, ours) in models_out.items():
        diff = max_diff(ours, np.load(exported / name / "logits.npy"))
        assert diff <= TOLERANCE, f"{name}: max |logits diff| {diff:.2e}"


def test_nope_mla_exports_as_kimi_linear_and_deepseek_v3_refuses_it():
    """DeepSeek-V3 rotates MLA's rotary part: a model whose MLA sees no position
    (model.mla.rope false) exports as Kimi Linear, whose MLA does not, and DeepSeek-V3 refuses
    it rather than writing one that does; Kimi Linear refuses MLA with RoPE."""
    cfg, _ = committed("deepseek_v3_grouped")
    nope = changed(cfg, mla={**cfg.mla.model_dump(), "rope": False}, rope={"theta": 10000.0})
    assert family_for(nope).model_type == "kimi_linear"
    with pytest.raises(ConversionError, match=r"model.mla.rope=false \(NoPE\)"):
        hf_config(nope, FAMILIES["deepseek_v3"], "float32", 0.02)
    with pytest.raises(ConversionError, match=r"model.mla.rope=true"):
        hf_config(cfg, FAMILIES["kimi_linear"], "float32", 0.02)
