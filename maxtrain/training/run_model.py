"""The run's model: the model package's decoder as this run's config asks for it.

The model package builds a decoder from a ModelSpec (the run's `model:` and `compute:`
sections and init.std, layers/spec.py) and knows nothing else of the run. What a run wraps
around it is decided here, once: the kernels and compute dtype of the platform the program is
built for, the pipeline's stage layout, the parameters a split adds (adapters:
training/split.py) and quantized matmuls (quantization/training.py). Training, evaluation,
inference, the tools and the memory estimate all take the model from `model_def(cfg)`, so
they run the same one.
"""

from __future__ import annotations

from flax import nnx

from maxtrain import models as model_lib
from maxtrain.config import Config, ConfigError
from maxtrain.layers.attention_pattern import kind_per_layer
from maxtrain.models import ModelDef, ModelSpec
from maxtrain.models.decoder import Decoder
from maxtrain.models.stacks import layer_kinds
from maxtrain.parallel.pipeline import StageLayout
from maxtrain.posttrain import parameter_split


def for_platform(
    cfg: Config, platform: str, device_kind: str = "", chips_per_slice: int = 1
) -> Config:
    """The config with the hardware's choices made (models/build.py platform_choices): for the
    devices the program is built for, which need not be this process's (a CPU host compiles
    for compile-only TPU devices, parallel/topology.py)."""
    cfg = with_max_logit(cfg)
    compute = model_lib.platform_choices(
        cfg.compute, cfg.model, platform, device_kind, chips_per_slice
    )
    return cfg.model_copy(update={"compute": compute})


def with_max_logit(cfg: Config) -> Config:
    """The config with compute.attention_max_logit on where optim.qk_clip_threshold is set:
    QK-clip (models/qk_clip.py) reads the max logits the model then reports."""
    if cfg.optim.qk_clip_threshold is None or cfg.compute.attention_max_logit:
        return cfg
    compute = cfg.compute.model_copy(update={"attention_max_logit": True})
    return cfg.model_copy(update={"compute": compute})


def model_spec(cfg: Config) -> ModelSpec:
    """What the model package builds the run's model from: its architecture, how the run
    computes it and the std of its initial weights (layers/spec.py)."""
    return ModelSpec(cfg.model, cfg.compute, cfg.init.std)


def stage_layout(cfg: Config) -> StageLayout | None:
    """The run's pipeline layout (None without stages); ConfigError if the model does not
    split into mesh.stage x pipeline.repeats equal groups of layers, after as many of its
    leading dense layers (a prologue, run on every stage) as that takes."""
    stages = cfg.mesh.stage * cfg.mesh.dcn.stage
    pipe = cfg.pipeline
    if stages == 1:
        return None
    kinds, attention = layer_kinds(cfg.model), kind_per_layer(cfg.model)
    prologue, size = _prologue(cfg, stages * pipe.repeats)
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
    if pipe.schedule == "interleaved_1f1b" and microbatches % stages:
        raise ConfigError(
            f"pipeline.microbatches={microbatches} is no multiple of the {stages} stages: "
            "interleaved_1f1b takes the micro-batches through each block in groups of S"
        )
    group = slice(prologue, prologue + size)
    return StageLayout(
        stages,
        pipe.repeats,
        microbatches,
        kinds[:prologue],
        kinds[group],
        attention[group],
        pipe.schedule,
    )


def _prologue(cfg: Config, groups: int) -> tuple[int, int]:
    """(the leading layers run before the pipeline, the layers of each of its `groups`): the
    fewest of an MoE model's leading dense layers after which the rest split into `groups`
    equal groups holding the same kinds of layers (stacks and attention kinds)."""
    layers = list(zip(layer_kinds(cfg.model), kind_per_layer(cfg.model), strict=True))
    moe = any(kind.is_moe for kind, _ in layers)
    dense = next((i for i, (kind, _) in enumerate(layers) if kind.is_moe), 0) if moe else 0
    for prologue in range(dense + 1):
        pipelined = len(layers) - prologue
        size = pipelined // groups
        if pipelined > 0 and not pipelined % groups:
            group = layers[prologue : prologue + size]
            if all(layers[prologue + g * size : prologue + (g + 1) * size] == group
                   for g in range(groups)):  # fmt: skip
                return prologue, size
    pipelined = len(layers) - dense
    if pipelined <= 0 or pipelined % groups:
        after = f" after the {dense} first dense layers" if dense else ""
        raise ConfigError(
            f"model.num_layers={cfg.model.num_layers} leaves {pipelined} layers{after}, not "
            f"divisible into {cfg.mesh.stage * cfg.mesh.dcn.stage} stages x "
            f"pipeline.repeats={cfg.pipeline.repeats}"
        )
    raise ConfigError(
        f"pipeline groups of {pipelined // groups} layers hold different kinds of layers: "
        f"model.layers must repeat every {pipelined // groups} layers"
        + (f" after its {dense} first dense layers" if dense else "")
    )


def build_model(cfg: Config, seed: int = 0, layout: StageLayout | None = None) -> Decoder:
    """A freshly initialised model, with the parameters the run's split adds (adapters)."""
    module = model_lib.build(model_spec(cfg), seed, layout)
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
    adapter_dtype = model_lib.compute_dtype(cfg.compute) if split.adds_parameters else None
    if cfg.quantization.preset != "none" or cfg.quantization.rules:
        # Imported only when asked for: Qwix and tokamax take seconds to import.
        from maxtrain.quantization import training as quantized_training

        module = quantized_training.quantize(module, cfg.quantization)
    return model_lib.define(
        module,
        model_spec(cfg),
        layout,
        adapter_dtype,
        qk_clip_threshold=cfg.optim.qk_clip_threshold,
    )
