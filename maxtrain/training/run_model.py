"""The run's model: the model package's decoder as this run's config asks for it.

The model package builds a decoder from its own ModelConfig and knows nothing of the run. What
a run wraps around it is decided here, once: the kernels and compute dtype of the platform the
program is built for, the pipeline's stage layout, the parameters a split adds (adapters:
training/split.py) and quantized matmuls (quantization/training.py). Training, evaluation,
inference, the tools and the memory estimate all take the model from `model_def(cfg)`, so
they run the same one.
"""

from __future__ import annotations

from flax import nnx

from maxtrain import models as model_lib
from maxtrain.config import Config, ConfigError
from maxtrain.layers.attention_pattern import kind_per_layer
from maxtrain.models import ModelDef
from maxtrain.models.decoder import Decoder
from maxtrain.models.stacks import layer_kinds
from maxtrain.parallel.pipeline import StageLayout
from maxtrain.posttrain import parameter_split


def for_platform(
    cfg: Config, platform: str, device_kind: str = "", chips_per_slice: int = 1
) -> Config:
    """The config with the hardware's choices made (model.platform_choices): for the devices
    the program is built for, which need not be this process's (a CPU host compiles for
    compile-only TPU devices, parallel/topology.py)."""
    cfg = with_max_logit(cfg)
    model = model_lib.platform_choices(cfg.model, platform, device_kind, chips_per_slice)
    return cfg.model_copy(update={"model": model})


def with_max_logit(cfg: Config) -> Config:
    """The config with model.attention_max_logit on where optim.qk_clip_threshold is set:
    QK-clip (models/qk_clip.py) reads the max logits the model then reports."""
    if cfg.optim.qk_clip_threshold is None or cfg.model.attention_max_logit:
        return cfg
    model = cfg.model.model_copy(update={"attention_max_logit": True})
    return cfg.model_copy(update={"model": model})


def stage_layout(cfg: Config) -> StageLayout | None:
    """The run's pipeline layout (None without stages); ConfigError if the model does not
    split into mesh.stage x pipeline.repeats equal groups of layers."""
    stages = cfg.mesh.stage * cfg.mesh.dcn.stage
    pipe = cfg.pipeline
    if stages == 1:
        return None
    kinds = layer_kinds(cfg.model)
    prologue = cfg.model.moe.first_dense_layers if cfg.model.moe is not None else 0
    pipelined = len(kinds) - prologue
    groups = stages * pipe.repeats
    if pipelined <= 0 or pipelined % groups:
        after = f" after the {prologue} first dense layers" if prologue else ""
        raise ConfigError(
            f"model.num_layers={cfg.model.num_layers} leaves {pipelined} layers{after}, not "
            f"divisible into {stages} stages x pipeline.repeats={pipe.repeats}"
        )
    size = pipelined // groups
    group = kinds[prologue : prologue + size]
    if any(kinds[prologue + g * size : prologue + (g + 1) * size] != group for g in range(groups)):
        interval = cfg.model.moe.interval if cfg.model.moe is not None else 1
        pattern = len(cfg.model.layer_pattern or ())
        raise ConfigError(
            f"pipeline groups of {size} layers hold different kinds of layers: "
            f"model.moe.interval ({interval}) and the length of model.layer_pattern "
            f"({pattern}) must divide {size}"
        )
    attention = kind_per_layer(cfg.model)
    group_attention = attention[prologue : prologue + size]
    if any(
        attention[prologue + g * size : prologue + (g + 1) * size] != group_attention
        for g in range(groups)
    ):
        raise ConfigError(
            f"pipeline groups of {size} layers hold different attention kinds: the length of "
            f"model.layer_pattern ({len(cfg.model.layer_pattern or ())}) must divide {size}"
        )
    microbatches = pipe.microbatches or stages
    if microbatches < stages:
        raise ConfigError(
            f"pipeline.microbatches={microbatches} is fewer than the {stages} stages; the "
            "circulating activations need at least one micro-batch per stage"
        )
    if cfg.micro_batch_size % microbatches:
        raise ConfigError(
            f"the micro-batch of {cfg.micro_batch_size} sequences (train.global_batch_size / "
            f"train.grad_accum_steps) does not split into pipeline.microbatches={microbatches}"
        )
    return StageLayout(stages, pipe.repeats, microbatches, kinds[:prologue], group, group_attention)


def build_model(cfg: Config, seed: int = 0, layout: StageLayout | None = None) -> Decoder:
    """A freshly initialised model, with the parameters the run's split adds (adapters)."""
    module = model_lib.build(cfg.model, seed, layout)
    parameter_split(cfg).adapt(module, seed)
    return module


def model_def(cfg: Config, pipelined: bool = True) -> ModelDef:
    """The model to run: pipelined if the mesh has stages (unless pipelined=False: the model
    in layer order, as checkpoints hold it); with what the split adds (adapters); with
    `quantization:` set, its matmuls quantized. Quantization changes only the graph
    definition: the params are the float model's."""
    cfg = with_max_logit(cfg)
    layout = stage_layout(cfg) if pipelined else None
    module = nnx.eval_shape(lambda: build_model(cfg, layout=layout))
    split = parameter_split(cfg)
    module = split.wrap(module)
    adapter_dtype = model_lib.compute_dtype(cfg.model) if split.adds_parameters else None
    if cfg.quantization.preset != "none" or cfg.quantization.rules:
        # Imported only when asked for: Qwix and tokamax take seconds to import.
        from maxtrain.quantization import training as quantized_training

        module = quantized_training.quantize(module, cfg.quantization)
    return model_lib.define(
        module, cfg.model, layout, adapter_dtype, qk_clip_threshold=cfg.optim.qk_clip_threshold
    )
