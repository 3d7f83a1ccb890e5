"""Configs, model files, overrides and checkpoints of an older maxtrain load as today's
(maxtrain/config/migration.py). tests/fixtures/old_configs/ holds committed files from before
the keys changed: presets and the default run's saved config.yml. Each old source is the same
config as today's, and says so in one note."""

import pytest
import yaml
from support import BASE, FIXTURES

from maxtrain import config as config_lib
from maxtrain.config import ConfigError

OLD = FIXTURES / "old_configs"
OLD_PRESETS = sorted(p.stem for p in OLD.glob("*.yml") if p.stem in config_lib.preset_names())


def test_the_fixtures_hold_every_kind_of_old_key():
    """Layer patterns (sliding, chunked, linear), NoPE global layers with their temperature,
    first dense layers, attention_type and its unused key/value heads, qk_norm_scale, RoPE keys,
    the old bias and capacity names: what the migration must map."""
    text = "".join((OLD / f"{name}.yml").read_text() for name in OLD_PRESETS)
    keys = ("layer_pattern", "local_attention", "chunk:", "linear", "global_attention",
            "first_dense_layers", "attention_type: mla", "qk_norm_scale", "rope_theta",
            "partial_rotary_factor", "router_bias", "expert_bias", "bias_update_rate")  # fmt: skip
    for key in keys:
        assert key in text, key


@pytest.mark.parametrize("name", OLD_PRESETS)
def test_an_old_model_file_is_todays_preset_with_one_note(name, capsys):
    old = config_lib.preset(str(OLD / f"{name}.yml"))
    assert old == config_lib.preset(name)
    note = capsys.readouterr().err
    assert note.startswith(f"maxtrain: note: {OLD / name}.yml: ") and note.count("\n") == 1


def test_the_default_runs_old_saved_config_is_todays_default_run(capsys):
    """The config.yml a default run of the layout before wrote (train.steps=20): its model's
    run-time keys moved to compute: and init:, the run otherwise the same."""
    saved = yaml.safe_load((OLD / "default-run-config.yml").read_text())
    assert "param_dtype" in saved["model"] and "compute" not in saved
    old = config_lib.validate_saved(saved, "the saved config")
    assert old == config_lib.load(BASE, ["train.steps=20"])
    note = capsys.readouterr().err
    assert note.startswith("maxtrain: note: the saved config: ") and note.count("\n") == 1
    assert "model.remat is now compute.remat" in note and "model.init_std is now init.std" in note


def test_old_overrides_are_todays_keys_with_one_note_for_the_command_line(capsys):
    old = config_lib.load(BASE, [
        "model_name=tiny-moe", "model.num_layers=5", "model.mlp_dim=64",
        "model.moe.first_dense_layers=1", "model.moe.interval=2",
        "model.moe.ep_dispatch=all_gather", "model.moe.capacity_factor=2",
        "model.rope_theta=500.0", "model.qk_norm=true", "model.remat=none",
    ])  # fmt: skip
    note = capsys.readouterr().err
    new = config_lib.load(BASE, [
        "model_name=tiny-moe", "model.num_layers=5", "model.mlp_dim=64",
        "model.layers=[global-dense, global-moe]",  # 1, 3 of 0..4: MoE
        "compute.expert_exchange=all_gather", "model.moe.expert_capacity_factor=2",
        "model.rope.theta=500.0", "model.qk_norm=rms", "compute.remat=none",
    ])  # fmt: skip
    assert old == new
    assert note.startswith("maxtrain: note: the command line: model.moe.first_dense_layers is ")
    assert "model.moe.ep_dispatch is now compute.expert_exchange" in note
    assert note.count("\n") == 1 and capsys.readouterr().err == ""  # new keys: no note


def test_old_keys_of_a_model_file_that_are_run_settings_move_to_compute(tmp_path):
    """A model file an older import wrote held the experts' kernel and exchange: they are
    compute: keys of the run now, under what the run's own config says."""
    old = yaml.safe_load((OLD / "tiny-mla.yml").read_text())
    old["moe"] |= {"grouped_matmul": "xla", "ep_dispatch": "all_gather", "balanced_routing": True}
    (tmp_path / "model.yml").write_text(yaml.safe_dump(old))
    cfg = config_lib.load(BASE, [f"model_name={tmp_path / 'model.yml'}", "compute.remat=none"])
    assert cfg.model == config_lib.preset("tiny-mla")
    compute = cfg.compute
    assert (compute.grouped_matmul, compute.expert_exchange) == ("xla", "all_gather")
    assert compute.balanced_routing and compute.remat == "none"


def test_old_layout_keys_apply_over_a_presets_layers():
    """model.moe.first_dense_layers on DeepSeek-V3 (three dense layers), a window on Gemma 3:
    what they say of the layers changes, the rest of model.layers stays."""
    deepseek = config_lib.load(BASE, ["model_name=deepseek-v3-671b", "model.num_layers=8",
                                      "model.moe.first_dense_layers=1"]).model  # fmt: skip
    assert deepseek.layers == ["global-dense", "global-moe*7"]
    gemma = config_lib.load(BASE, ["model_name=gemma3-1b", "model.local_attention.window=64"])
    assert (gemma.model.layers, gemma.model.sliding_window) == (
        ["sliding-dense*5", "global-dense"],
        64,
    )


def test_a_later_model_layers_replaces_an_older_sources_layout_keys(tmp_path):
    (tmp_path / "old.yml").write_text(
        "model_name: tiny\nmodel:\n  layer_pattern: [local, global]\n"
        "  local_attention: {window: 4}\n"
    )
    assert config_lib.load(tmp_path / "old.yml").model.layers == ["sliding-dense", "global-dense"]
    linear = ["model.layers=[linear-dense, global-dense]",
              "model.linear_attention={num_key_heads: 1, num_value_heads: 2}"]  # fmt: skip
    cfg = config_lib.load(tmp_path / "old.yml", linear).model
    assert (cfg.layers, cfg.sliding_window) == (["linear-dense", "global-dense"], None)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.global_attention={rope: false, qk_norm: true}"], "has no equivalent now"),
        (["model.attention_type=mla"], "model.attention_type mla .* but model.mla is absent"),
        (["model.layer_pattern=[local]"], "which need model.sliding_window"),
    ],
)
def test_an_old_key_that_says_nothing_today_can_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        config_lib.load(BASE, ["model_name=tiny", *overrides])
    assert "\n" not in str(e.value)
