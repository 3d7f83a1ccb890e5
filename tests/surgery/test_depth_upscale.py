"""Depth upscaling: a deeper model of exact layer copies, its layer maps, presets and tool."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.checkpointing import Checkpointer, CheckpointError, load_parameters
from maxtrain.checkpointing.export import save_parameters
from maxtrain.config import ConfigError
from maxtrain.parallel.mesh import build_mesh
from maxtrain.surgery import cli, depth_upscale, solar_layer_map
from maxtrain.surgery.initialize import abstract_params, check_fits, source_config, transform
from maxtrain.training.run_model import model_spec

# 4 layers, MoE every second one (layers 1 and 3), with a balancing bias in the MoE stack.
MOE_EVERY_SECOND = (
    "model.num_layers=4",
    "model.layers=[global-dense, global-moe]",
    "model.moe={num_experts: 4, top_k: 2, expert_mlp_dim: 16, balance_bias_update_rate: 0.1}",
)


def init_params(cfg: config_lib.Config) -> dict:
    spec = model_spec(cfg)
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(model_lib.build(spec, 1), nnx.Param)))()


def layer(params: dict, cfg: config_lib.Config, i: int) -> dict:
    """Model layer i's parameters, found by counting (independently of the transforms' code)."""
    kinds = [cfg.model.is_moe_layer(j) for j in range(cfg.model.num_layers)]
    position = sum(kind == kinds[i] for kind in kinds[:i])
    stack = params["moe_layers" if kinds[i] else "layers"]
    return jax.tree.map(lambda a: a[position], stack)


@pytest.mark.parametrize(
    ("source_overrides", "layer_map"),
    [((), [1, 0, 1, 1, 0]), (MOE_EVERY_SECOND, solar_layer_map(4, 1))],
    ids=["dense-reordered-and-repeated", "moe-every-second-solar"],
)
def test_copied_layers_are_bit_identical_to_their_sources(make_cfg, source_overrides, layer_map):
    source = make_cfg(*source_overrides)
    target = make_cfg(*source_overrides, f"model.num_layers={len(layer_map)}")
    params = init_params(source)
    deep = jax.jit(functools.partial(depth_upscale, cfg=source.model, layer_map=layer_map))(params)

    assert sum(x.size for x in jax.tree.leaves(deep)) == model_lib.param_count(target.model)
    for i, copied in enumerate(layer_map):
        original = layer(params, source, copied)
        copy = layer(deep, target, i)
        for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(original), strict=True):
            np.testing.assert_array_equal(a, b)
    for name in ("embedding", "final_norm", "lm_head"):
        for a, b in zip(jax.tree.leaves(deep[name]), jax.tree.leaves(params[name]), strict=True):
            np.testing.assert_array_equal(a, b)


def test_solar_map_and_its_config_spelling(make_cfg):
    solar = solar_layer_map(32, 8)  # SOLAR 10.7B: 32 layers, m = 8 -> 48
    assert solar == [*range(24), *range(8, 32)]
    cfg = make_cfg(
        "model.num_layers=48",
        "init.mode=depth_upscale",
        "init.source_model=tiny",
        "init.layer_map=[0..23, 8..31]",
        "checkpoint.load_parameters_path=unused",
    )
    assert cfg.init.layer_map == solar
    with pytest.raises(ConfigError, match="in 0..3"):
        solar_layer_map(4, 4)


def test_kanana_9_1b_config_upscales_kanana_8b(make_cfg):
    """37 layers, the depth closest to 9.1B; checked on shapes alone (no memory)."""
    path = config_lib.CONFIGS_DIR / "kanana-9.1b-dus.yml"
    cfg = config_lib.load(path, ["checkpoint.load_parameters_path=unused"])
    source = source_config(cfg)
    total, base = model_lib.param_count(cfg.model), model_lib.param_count(source.model)
    assert (total, base) == (9_120_821_248, 8_030_261_248)
    per_layer = (total - base) // 5
    closest = min(range(32, 48), key=lambda n: abs(9.1e9 - (base + (n - 32) * per_layer)))
    assert closest == cfg.model.num_layers == 37
    assert cfg.init.layer_map == [*range(19), *range(14, 32)]
    mesh = build_mesh(cfg.mesh)
    produced = jax.eval_shape(
        lambda p: transform(p, source.model, cfg), abstract_params(source, mesh, rules=cfg)
    )
    check_fits(cfg, produced, abstract_params(cfg, mesh))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("init.layer_map=[0..1, 3..2]",), r"'3..2' is not a range a..b"),
        (("init.layer_map=[0, -1, 1]",), r"'init\.layer_map\[1\]' must be >= 0 \(got -1\)"),
        (("init.layer_map=[0..1]",), "lists 2 layers, but model.num_layers is 3"),
        (("init.layer_map=null",), "needs init.layer_map"),
        (("init.source_model=null",), "needs init.source_model"),
        (("checkpoint.load_parameters_path=null",), "needs checkpoint.load_parameters_path"),
    ],
)
def test_config_mistakes_are_one_line_errors(make_cfg, overrides, message):
    depth_3 = ("model.num_layers=3", "init.mode=depth_upscale", "init.source_model=tiny",
               "init.layer_map=[0, 1, 1]", "checkpoint.load_parameters_path=somewhere")  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        make_cfg(*depth_3, *overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.num_layers=3", "init.layer_map=[0, 1, 2]"), "names layer 2, but the source"),
        # layers 0..3, then 2..3 again: MoE at 1, 3, 5, where model.layers wants 5 only
        (
            (
                *MOE_EVERY_SECOND,
                "model.num_layers=6",
                "model.layers=[global-dense*5, global-moe]",
                "init.layer_map=[0..3, 2..3]",
            ),
            r"gives MoE layers \[1, 3, 5\].*makes layers \[5\]",
        ),
    ],
)
def test_maps_the_models_do_not_allow_are_caught_on_shapes_alone(make_cfg, overrides, message):
    cfg = make_cfg("init.mode=depth_upscale", "init.source_model=tiny",
                   "checkpoint.load_parameters_path=unused", *overrides)  # fmt: skip
    moe = MOE_EVERY_SECOND[0] in overrides
    source = make_cfg(*MOE_EVERY_SECOND) if moe else make_cfg("model.num_layers=2")
    with pytest.raises(ConfigError, match=message):
        jax.eval_shape(
            lambda p: transform(p, source.model, cfg), abstract_params(source, build_mesh(cfg.mesh))
        )


def test_tool_writes_exact_copies_atomically_or_nothing(make_cfg, tmp_path, capsys, monkeypatch):
    source_cfg = make_cfg()
    params = init_params(source_cfg)
    source = save_parameters(tmp_path / "source", params)
    out = tmp_path / "deep"
    base = [str(config_lib.CONFIGS_DIR / "base.yml"), "model_name=tiny", "data.kind=synthetic",
            "model.num_layers=3", "init.source_model=tiny", "init.layer_map=[0, 1, 1]"]  # fmt: skip
    args = [*base, "--source", str(source), "--output", str(out)]

    assert cli.main("depth_upscale", args, "depth_upscale") == 0
    target = make_cfg("model.num_layers=3")
    written = load_parameters(out, abstract_params(target, build_mesh(target.mesh)))
    expected = depth_upscale(params, source_cfg.model, [0, 1, 1])
    for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    by_path = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", [f"model_name={out}/model.yml"])
    assert by_path.model.num_layers == 3
    assert model_lib.param_count(by_path.model) == model_lib.param_count(target.model)
    assert f"model_name={out}/model.yml" in capsys.readouterr().out

    assert cli.main("depth_upscale", args, "") == 2  # the output exists: refused, untouched
    assert "already exists" in capsys.readouterr().err

    write = Checkpointer.save_now

    def fail_after_writing(*args, **kwargs):
        write(*args, **kwargs)
        assert [p.name for p in tmp_path.glob("again.partial-*")]  # written, then cleaned up
        raise CheckpointError("no space left on device")

    monkeypatch.setattr(Checkpointer, "save_now", fail_after_writing)
    again = [*base, "--source", str(source), "--output", str(tmp_path / "again")]
    assert cli.main("depth_upscale", again, "") == 2
    err = capsys.readouterr().err
    assert err == "depth_upscale: error: no space left on device\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "source"]  # no partial output


SLIDING_GLOBAL = ("model.layers=[sliding-dense, global-dense]", "model.sliding_window=4")
CARRIED = "model.layers=[sliding-dense, global-dense*2]"


@pytest.mark.parametrize(
    ("target_overrides", "message"),
    [
        (SLIDING_GLOBAL, r"kinds \[sliding, global, global\].*gives \[sliding, global, sliding"),
        (
            (CARRIED, "model.sliding_window=8"),
            r"model.sliding_window \(8\) differs from the source model's \(4\)",
        ),
        ((), r"\[sliding, global, global\], but model.layers gives all global"),
    ],
)
def test_copies_keep_the_attention_of_their_source_layers(make_cfg, target_overrides, message):
    """A copied layer keeps its attention kind (a sliding window stays a sliding window): the
    new model's layers must say so, or the transform names both patterns."""
    source = make_cfg("model.num_layers=2", *SLIDING_GLOBAL)
    depth = ("init.mode=depth_upscale", "init.source_model=tiny", "model.num_layers=3",
             "init.layer_map=[0, 1, 1]", "checkpoint.load_parameters_path=unused")  # fmt: skip
    mesh = build_mesh(source.mesh)
    upscale = lambda cfg: jax.eval_shape(  # noqa: E731
        lambda p: transform(p, source.model, cfg), abstract_params(source, mesh)
    )
    with pytest.raises(ConfigError, match=message):
        upscale(make_cfg(*depth, *target_overrides))
    carried = make_cfg(*depth, CARRIED, "model.sliding_window=4")
    check_fits(carried, upscale(carried), abstract_params(carried, mesh))
