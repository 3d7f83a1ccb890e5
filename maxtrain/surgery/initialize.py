"""A new run's parameters from a checkpoint: `checkpoint.load_parameters_path` read as the
model `init.source_model` and turned into this run's model per `init.mode`.

    mode none           the checkpoint holds this very model: its parameters as they are
    mode upcycle        a dense checkpoint becomes this mixture-of-experts model (upcycle.py)
    mode depth_upscale  this model's layers are copies of the checkpoint's (depth.py)

The train loop calls initial_params when a run starts with no checkpoint of its own (resume
always wins); tools/upcycle.py and tools/depth_upscale.py call it to write the
result to disk.
Config mistakes surface before a byte of the checkpoint is read: the transform is traced on
shapes alone and its result checked against the model.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from maxtrain import config as config_lib
from maxtrain.checkpointing import load_parameters
from maxtrain.checkpointing.integrity import flat_shapes
from maxtrain.config import Config, ConfigError, ModelConfig
from maxtrain.models.stacks import is_moe_per_layer
from maxtrain.surgery.depth import copied_kinds, depth_upscale
from maxtrain.surgery.upcycle import upcycle
from maxtrain.training.run_model import model_def
from maxtrain.training.state import param_shardings


def initial_params(cfg: Config, target: Any) -> Any:
    """This run's starting parameters, laid out like `target` (the model's params as
    ShapeDtypeStructs with NamedShardings). Raises ConfigError for a transform the two models
    do not allow, CheckpointError for a missing checkpoint or one of another model."""
    path = cfg.checkpoint.load_parameters_path
    if cfg.init.mode == "none":
        return load_parameters(path, target)
    source_cfg = source_config(cfg)
    mesh = jax.tree.leaves(target)[0].sharding.mesh
    source = abstract_params(source_cfg, mesh, rules=cfg)
    fn = functools.partial(transform, source=source_cfg.model, cfg=cfg)
    check_fits(cfg, jax.eval_shape(fn, source), target)
    params = load_parameters(path, source)
    return jax.jit(fn, out_shardings=jax.tree.map(lambda t: t.sharding, target))(params)


def source_config(cfg: Config) -> Config:
    """The checkpoint's model as a run of it is configured (configs/base.yml <- its preset),
    kept in this run's compute.param_dtype: the dtype it is read and transformed in."""
    try:
        return config_lib.load(
            config_lib.CONFIGS_DIR / "base.yml",
            [
                f"model_name={cfg.init.source_model}",
                f"compute.param_dtype={cfg.compute.param_dtype}",
            ],
        )
    except ConfigError as e:
        raise ConfigError(f"init.source_model: {e}") from None


def transform(params: Any, source: ModelConfig, cfg: Config) -> Any:
    """The pure transform init.mode names, from `source`'s parameters to cfg.model's."""
    init = cfg.init
    if init.mode == "upcycle":
        _check_attention(
            source, cfg.model, [source.layer_attention(i) for i in range(source.num_layers)]
        )
        return upcycle(
            params,
            source,
            cfg.model,
            noise_std=init.noise_std,
            router_init_std=init.router_init_std,
            seed=cfg.run.seed,
        )
    if init.mode == "depth_upscale":
        assert init.layer_map is not None  # the config requires it in this mode
        kinds = tuple(kind.is_moe for kind in copied_kinds(source, init.layer_map))
        if kinds != is_moe_per_layer(cfg.model):
            raise ConfigError(
                f"init.layer_map gives MoE layers {_moe_indices(kinds)} (the kinds of the "
                f"source layers it copies), but model.layers makes layers "
                f"{_moe_indices(is_moe_per_layer(cfg.model))} MoE"
            )
        _check_attention(source, cfg.model, [source.layer_attention(i) for i in init.layer_map])
        return depth_upscale(params, source, init.layer_map)
    raise ValueError(f"init.mode {init.mode!r} has no transform")


def abstract_params(cfg: Config, mesh: Mesh, rules: Config | None = None) -> Any:
    """cfg's model parameters as checkpoints hold them (layers in model order, whatever the
    pipeline) as ShapeDtypeStructs, sharded over mesh per the mesh.rules of `rules` (default:
    cfg's own)."""
    mdef = model_def(cfg, pipelined=False)
    shardings = param_shardings(mdef, rules or cfg, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nnx.to_pure_dict(mdef.abstract_state),
        shardings,
    )


def check_fits(cfg: Config, produced: Any, target: Any) -> None:
    """Raises ConfigError naming the first parameter the transform gets wrong for the model
    (a width that differs between the two models, a missing qk-norm, ...)."""
    got, want = flat_shapes(produced), flat_shapes(target)
    for path in [*want, *(p for p in got if p not in want)]:
        if got.get(path) != want.get(path):
            raise ConfigError(
                f"init.mode={cfg.init.mode} from model {cfg.init.source_model} does not give "
                f"model {cfg.model_name}: {path!r} would be {_shape(got.get(path))}, the "
                f"model's is {_shape(want.get(path))}"
            )


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))


# What a layer of an attention kind reads besides its parameters: the model's keys that a copy
# keeps from its source.
_KIND_KEYS = {
    "sliding": ("sliding_window", "rope.local_theta"),
    "chunked": ("attention_chunk", "rope.local_theta"),
    "nope": ("attention_temperature",),
}


def _check_attention(source: ModelConfig, model: ModelConfig, copied: list[str]) -> None:
    """Raises ConfigError unless every new layer has the attention of the source layer it
    copies (`copied`: their kinds), with the same window, chunk, local RoPE base or
    temperature: a transform carries the attention pattern, it does not change it."""
    wanted = [model.layer_attention(i) for i in range(model.num_layers)]
    if copied != wanted:
        raise ConfigError(
            f"the layers copied from {source.num_layers} source layers have attention kinds "
            f"{_pattern(copied)}, but model.layers gives {_pattern(wanted)}; set "
            "model.layers to the copies' kinds"
        )
    for key in dict.fromkeys(k for kind in set(copied) for k in _KIND_KEYS.get(kind, ())):
        theirs, ours = _dotted(source, key), _dotted(model, key)
        if theirs != ours:
            raise ConfigError(
                f"model.{key} ({ours}) differs from the source model's ({theirs}); the copied "
                "layers keep theirs"
            )


def _dotted(model: ModelConfig, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), model)


def _pattern(kinds: list[str]) -> str:
    """Kinds as a short string: 'global' when all are, else the list."""
    return "all global" if set(kinds) == {"global"} else "[" + ", ".join(kinds) + "]"


def _moe_indices(kinds: tuple[bool, ...]) -> list[int]:
    return [i for i, is_moe in enumerate(kinds) if is_moe]
