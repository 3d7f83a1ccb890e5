"""Config: merge order, parents, CLI overrides, derived values and one-line errors."""

from pathlib import Path

import pytest
import yaml

from maxtrain import config as config_lib
from maxtrain.config import ConfigError

BASE = config_lib.CONFIGS_DIR / "base.yml"


def test_merge_order_base_then_model_then_file_then_cli(tmp_path):
    parent = tmp_path / "parent.yml"
    parent.write_text("model_name: tiny\noptim:\n  lr: 0.5\n  b1: 0.8\ntrain:\n  steps: 7\n")
    child = tmp_path / "child.yml"
    child.write_text("base_config: parent.yml\noptim:\n  lr: 0.25\nmodel:\n  num_layers: 3\n")
    cfg = config_lib.load(child, ["optim.b1=0.7", "model.qk_norm=rms"])
    assert cfg.model_name == "tiny"
    assert cfg.model.emb_dim == 64  # from configs/models/tiny.yml
    assert cfg.model.num_layers == 3  # the config file beats the model file
    assert cfg.optim.lr == 0.25  # child beats parent
    assert cfg.optim.b1 == 0.7  # CLI beats everything
    assert cfg.model.qk_norm == "rms"
    assert cfg.train.steps == 7  # parent beats base
    assert cfg.optim.b2 == 0.95  # base default survives


def test_overlay_files_and_overrides_apply_left_to_right(tmp_path):
    """What follows the config file: an overlay merges as a config file does (a layout the
    planner wrote), a key=value before it is overwritten by it, one after it wins."""
    overlay = tmp_path / "plan.yml"
    overlay.write_text("mesh:\n  fsdp: 4\n  tensor: 2\ntrain:\n  steps: 9\n")
    cfg = config_lib.load(BASE, ["model_name=tiny", "train.steps=3", str(overlay), "mesh.fsdp=2"])
    assert (cfg.mesh.fsdp, cfg.mesh.tensor, cfg.train.steps) == (2, 2, 9)
    assert cfg.mesh.data == 1  # the overlay's mesh merged into the config's, not replacing it
    with pytest.raises(ConfigError, match="config file not found: .*nope.yml"):
        config_lib.load(BASE, ["model_name=tiny", str(tmp_path / "nope.yml")])


def test_model_name_from_cli_selects_model_file():
    cfg = config_lib.load(BASE, ["model_name=llama3-8b", "mesh.fsdp=8", "optim.lr=3e-4"])
    assert cfg.model.emb_dim == 4096 and cfg.model.num_layers == 32
    assert cfg.mesh.fsdp == 8 and cfg.optim.lr == 3e-4


def test_derived_values_are_computed_from_their_sources():
    cfg = config_lib.load(
        BASE,
        [
            "train.global_batch_size=12",
            "train.seq_len=64",
            "train.steps=10",
            "train.grad_accum_steps=3",
        ],
    )
    assert cfg.model.resolved_head_dim == cfg.model.emb_dim // cfg.model.num_heads
    assert cfg.tokens_per_step == 12 * 64
    assert cfg.total_tokens == 12 * 64 * 10
    assert cfg.micro_batch_size == 4


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("trian.steps=3", "unknown config key 'trian'; did you mean 'train'?"),
        ("model.num_layer=3", "did you mean 'model.num_layers'?"),
        # A misspelt key in a list item: named before the required key it leaves unset.
        (
            "data.sources=[{name: a, pth: x}]",
            "unknown config key 'data.sources[0].pth'; did you mean 'data.sources[0].path'?",
        ),
        ("train.steps=many", "config key 'train.steps'"),
        ("train.steps=0", "config key 'train.steps'"),
        ("compute.remat=some", "config key 'compute.remat'"),
        # An old key where migration does not look (config/migration.py): its new name.
        ("compute.ep_dispatch=ragged", "'compute.ep_dispatch'; it is now compute.expert_exchange"),
        ("model.layers=[global-mo]", "config key 'model.layers[0]' must be ATTENTION-FFN or"),
        ("model.layers=[sliding-dense]", "model.layers has sliding layers, which need model"),
        ("model.sliding_window=8", "model.sliding_window is set but model.layers has no sliding"),
        ("model_name=llama-8b", "model_name 'llama-8b' has no file"),
        ("mesh.rules.embed=[gpu]", "config key 'mesh.rules.embed[0]' must be one of 'data'"),
        ("model.num_kv_heads=3", "must be a multiple of model.num_kv_heads"),
        ("train.grad_accum_steps=5", "must be divisible by train.grad_accum_steps"),
        ("optim", "is not of the form key=value"),
    ],
)
def test_user_mistakes_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        config_lib.load(BASE, ["model_name=tiny", override])
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yml"):
        config_lib.load(tmp_path / "nope.yml")


def test_base_config_cycle_is_reported(tmp_path):
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    with pytest.raises(ConfigError, match="cycle"):
        config_lib.load(tmp_path / "a.yml")


@pytest.mark.parametrize("name", ["sft.yml", "dpo.yml", "lora.yml"])
def test_committed_configs_find_their_data_from_any_directory(name, tmp_path, monkeypatch):
    """The data files a committed config names are found wherever the command runs: relative
    paths in a config file resolve beside it (lora.yml through its parent sft.yml)."""
    monkeypatch.chdir(tmp_path)
    overrides = ["checkpoint.load_parameters_path=ckpt"] if name != "sft.yml" else []
    cfg = config_lib.load(config_lib.CONFIGS_DIR / name, overrides)
    for source in cfg.data.sources:
        path = Path(source.path)
        assert path.is_absolute() and path.is_file(), source.path
        assert path.parent == config_lib.REPO_ROOT / "maxtrain" / "data" / "assets"


def test_file_paths_resolve_beside_the_file_and_overrides_from_the_working_directory(
    tmp_path, monkeypatch
):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "run.yml").write_text(
        "data:\n  sources:\n    - {name: a, path: shards/*.arrayrecord}\n"
        "    - {name: b, path: 'embedded:prose'}\n    - {name: c, path: /abs/x}\n"
        "  tokenizer: tok\n  chat_template: chatml\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = config_lib.load(folder / "run.yml")
    assert [s.path for s in cfg.data.sources] == [
        str(folder / "shards" / "*.arrayrecord"), "embedded:prose", "/abs/x",
    ]  # fmt: skip
    assert cfg.data.tokenizer == str(folder / "tok") and cfg.data.chat_template == "chatml"
    overridden = config_lib.load(
        folder / "run.yml", ["data.tokenizer=tok", "data.sources=[{name: a, path: here}]"]
    )
    assert overridden.data.tokenizer == "tok" and overridden.data.sources[0].path == "here"


def _walk(given: dict, validated: dict, defaults: dict, prefix: str):
    """(dotted key, validated value, default) for every leaf of `given`; a mapping is walked
    where the schema has a section (its value validated is a dict of the same keys)."""
    for key, value in given.items():
        nested = isinstance(value, dict) and value and isinstance(defaults.get(key), dict)
        if nested and key != "rules":
            yield from _walk(value, validated[key], defaults[key], f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", validated[key], defaults[key]


def _leaves(name: str) -> list[tuple[str, object, object]]:
    """A config file's keys, each with its value as validated (shorthands such as `sources:
    embedded` expanded) and the schema's default. The model section's shape keys have no
    default: its run-time keys are compared as given."""
    tree = yaml.safe_load((config_lib.CONFIGS_DIR / name).read_text())
    out = []
    for section, given in tree.items():
        if section == "model_name":
            continue
        schema = config_lib.Config.model_fields[section].annotation
        if schema is config_lib.ModelConfig:
            fields = schema.model_fields
            defaults = {k: fields[k].get_default(call_default_factory=True) for k in given}
            defaults["mtp"] = fields["mtp"].get_default(call_default_factory=True).model_dump()
            out += _walk(given, given, defaults, "model.")
        else:
            validated = schema.model_validate(given).model_dump()
            out += _walk(given, validated, schema().model_dump(), f"{section}.")
    return out


def test_the_reference_lists_every_key_at_the_schemas_default():
    """configs/reference.yml is what a user reads: every key there, each at its default."""
    leaves = _leaves("reference.yml")
    assert [(k, v, d) for k, v, d in leaves if v != d] == []
    listed = {k for k, _, _ in leaves}
    for section, field in config_lib.Config.model_fields.items():
        if section in ("base_config", "model_name", "model"):
            continue
        for key in field.annotation.model_fields:
            assert f"{section}.{key}" in listed or any(
                k.startswith(f"{section}.{key}.") for k in listed
            ), f"{section}.{key} missing from configs/reference.yml"
    text = (config_lib.CONFIGS_DIR / "reference.yml").read_text()
    model_section = text[text.index("\nmodel:") : text.index("\ncompute:")]
    for key in config_lib.ModelConfig.model_fields:  # set in a model file: named in comments
        assert f" {key}" in model_section, f"model.{key} missing from configs/reference.yml"


def test_base_yml_restates_no_default():
    """configs/base.yml sets only what the default run changes: one source for every default."""
    assert [k for k, v, d in _leaves("base.yml") if v == d] == []


def test_a_section_given_in_part_keeps_the_rest_of_its_default():
    cfg = config_lib.load(
        BASE, ["checkpoint.local.every_steps=7", "mesh.rules.length=[]", "optim.muon.ns_steps=3"]
    )
    assert (cfg.checkpoint.local.every_steps, cfg.checkpoint.local.keep) == (7, 2)
    assert cfg.checkpoint.persistent.every_steps == 500
    assert cfg.mesh.rules["length"] == [] and cfg.mesh.rules["embed"] == ["fsdp"]
    assert (cfg.optim.muon.ns_steps, cfg.optim.muon.momentum) == (3, 0.95)
