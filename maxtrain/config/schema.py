"""The config schema: every key a run config may hold, its type, default and checks, and the
values derived from others (head_dim, global batch in tokens, parallel degrees), computed once,
here, and nowhere else. How a config is assembled from files and overrides is loading.py.

Every key declares its domain where it is declared: its type, its bounds (`Field(gt=...)` or
the named types below), its choices (`Literal`), and finiteness: every float is finite
(`allow_inf_nan=False`, in each named float type). A value outside it is refused by pydantic,
and loading.py turns that into one line naming the key, the value and the domain;
tests/test_config_domains.py walks the schema and tries a value outside every declared domain.
Checks that involve several keys are the validators.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MESH_AXES = ("data", "stage", "fsdp", "context", "tensor", "expert")
MeshAxis = Literal[MESH_AXES]
# Mesh axes not implemented yet: a degree other than 1 (within or across slices) is refused
# rather than silently running every stage/shard on the same work. Drop an axis once it works.
UNIMPLEMENTED_AXES = ("context",)

# Named domains. Every float is finite: inf/nan in a config is always a mistake.
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]  # a share in [0, 1]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be positive or -1")
    return value


# A count that may also be -1, meaning "all that remain" (mesh degrees) or "off" (profile).
PositiveOrMinusOne = Annotated[int, Field(ge=-1), AfterValidator(_not_zero)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class RopeScaling(_Section):
    """Llama-3 style RoPE frequency scaling (absent = no scaling)."""

    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position: PositiveInt = 8192

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})"
            )
        return self


class MoeConfig(_Section):
    """Mixture-of-experts feed-forward layers (absent = a dense model)."""

    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_mlp_dim: int = Field(gt=0)  # hidden size of each routed expert (SwiGLU)
    shared_experts: int = Field(default=0, ge=0)  # always-on experts, fused into one SwiGLU
    score: Literal["softmax", "sigmoid"] = "softmax"  # router score function
    renormalize: bool = True  # rescale the top-k weights to sum to 1
    routed_scale: PositiveFloat = 1.0  # multiplies the routed experts' output
    # Which layers are MoE: layer i (0-based) is MoE iff i >= first_dense_layers and
    # (i + 1) % interval == 0. interval 1 = every layer; 2 = every second layer (1, 3, ...).
    first_dense_layers: int = Field(default=0, ge=0)
    interval: int = Field(default=1, gt=0)
    aux_loss_weight: NonNegativeFloat = 0.0  # Switch-style load-balancing loss
    router_z_loss_weight: NonNegativeFloat = 0.0  # ST-MoE router logit z-loss
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for top-k
    # selection only, moved by `bias_update_rate` toward equal load after every step.
    bias_update_rate: NonNegativeFloat = 0.0  # 0 disables
    # null: dropless (tokens sorted by expert, grouped matmul). A number: each expert takes at
    # most capacity_factor * tokens * top_k / num_experts tokens per device; the rest drop.
    capacity_factor: PositiveFloat | None = None
    grouped_matmul: Literal["auto", "xla", "tokamax"] = "auto"  # auto: tokamax on GPU/TPU
    # Dropless with experts split over devices (mesh.expert > 1): how rows reach their experts
    # (layers/expert_parallel.py). auto: ragged on GPU/TPU, all_to_all elsewhere.
    ep_dispatch: Literal["auto", "all_to_all", "ragged", "all_gather"] = "auto"
    # Its buffers hold this many times the routed rows; rows beyond are dropped (moe/dropped).
    # >= mesh.expert never drops (worst-case buffers, P times the traffic).
    ep_capacity_factor: PositiveFloat = 1.25

    def is_moe_layer(self, layer: int) -> bool:
        """Whether model layer `layer` (0-based) is a mixture of experts."""
        return layer >= self.first_dense_layers and (layer + 1) % self.interval == 0

    @model_validator(mode="after")
    def _check_routing(self) -> MoeConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) exceeds model.moe.num_experts ({self.num_experts})"
            )
        return self


class ModelArchitecture(_Section):
    """The model itself: what its parameters' shapes and its function depend on. A model file
    (configs/models/<name>.yml) holds these keys; tools/convert_hf.py writes them."""

    vocab_size: int = Field(gt=0)
    emb_dim: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: PositiveInt | None = None  # None: emb_dim // num_heads
    mlp_dim: int = Field(gt=0)
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    norm_eps: PositiveFloat = 1e-5
    max_seq_len: PositiveInt = 8192
    moe: MoeConfig | None = None

    @model_validator(mode="after")
    def _check_heads(self) -> ModelArchitecture:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.moe is not None and not any(map(self.moe.is_moe_layer, range(self.num_layers))):
            raise ValueError(
                f"model.moe makes no layer a mixture of experts: first_dense_layers "
                f"({self.moe.first_dense_layers}) and interval ({self.moe.interval}) leave all "
                f"{self.num_layers} layers dense"
            )
        if self.head_dim is None and self.emb_dim % self.num_heads:
            raise ValueError(
                f"model.emb_dim ({self.emb_dim}) is not divisible by model.num_heads "
                f"({self.num_heads}); set model.head_dim explicitly"
            )
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.emb_dim // self.num_heads


class ModelConfig(ModelArchitecture):
    """The `model:` section of a run: the architecture, and how this run initialises, stores
    and computes it (configs/base.yml sets these run-time keys)."""

    init_std: NonNegativeFloat = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    scan_layers: bool = True
    remat: Literal["none", "full", "minimal"] = "full"
    attention: Literal["auto", "xla", "mosaic", "cudnn", "triton", "xla_chunked", "tokamax_xla"] = (
        "auto"
    )


class MeshAxes(_Section):
    """Degree of each mesh axis; -1 means 'the devices that remain' (at most one -1)."""

    data: PositiveOrMinusOne = 1
    stage: PositiveInt = 1  # given, never -1: the stages split the model's layers
    fsdp: PositiveOrMinusOne = -1
    context: PositiveOrMinusOne = 1
    tensor: PositiveOrMinusOne = 1
    expert: PositiveOrMinusOne = 1


class DcnAxes(_Section):
    """Degree of each mesh axis across slices (data-center network); the product = num_slices."""

    data: PositiveInt = 1
    stage: PositiveInt = 1
    fsdp: PositiveInt = 1
    context: PositiveInt = 1
    tensor: PositiveInt = 1
    expert: PositiveInt = 1


class MeshConfig(MeshAxes):
    num_slices: int = Field(default=1, gt=0)
    dcn: DcnAxes = DcnAxes()
    # Logical axis name -> mesh axes it is sharded over. Layer code names only logical axes.
    rules: dict[str, list[MeshAxis]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_implemented(self) -> MeshConfig:
        for axis in UNIMPLEMENTED_AXES:
            for key, degree in (
                (axis, getattr(self, axis)),
                (f"dcn.{axis}", getattr(self.dcn, axis)),
            ):
                if degree != 1:
                    raise ValueError(
                        f"mesh.{key}={degree}: {axis} parallelism is not implemented yet; "
                        "set it to 1"
                    )
        return self


class OptimConfig(_Section):
    lr: NonNegativeFloat = 3e-4
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(default=100, ge=0)
    min_lr_ratio: Fraction = 0.1
    wsd_decay_fraction: float = Field(default=0.2, gt=0, le=1, allow_inf_nan=False)
    b1: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)  # Adam's decay rates
    b2: float = Field(default=0.95, ge=0, lt=1, allow_inf_nan=False)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.1
    clip_norm: NonNegativeFloat = 1.0  # 0 disables clipping


class PipelineConfig(_Section):
    """Pipeline parallelism over mesh.stage x mesh.dcn.stage stages (models/pipeline.py)."""

    # gpipe: each stage holds one block of consecutive layers; circular: `repeats` blocks
    # spread over the depth, so the idle bubble (S - 1) / (R * M + S - 1) shrinks with R.
    schedule: Literal["gpipe", "circular"] = "gpipe"
    microbatches: int | None = Field(default=None, gt=0)  # M per step; null: the stage count
    repeats: int = Field(default=1, gt=0)  # circular: layer blocks per stage

    @model_validator(mode="after")
    def _check_schedule(self) -> PipelineConfig:
        if self.schedule == "gpipe" and self.repeats != 1:
            raise ValueError(
                f"pipeline.repeats={self.repeats} needs pipeline.schedule=circular (gpipe "
                "holds one block of layers per stage)"
            )
        return self


class DataSource(_Section):
    """One prepared corpus in the mixture (a directory or glob of tokenized shards), or with
    data.kind megatron one Megatron corpus (the prefix of PREFIX.bin / PREFIX.idx)."""

    # Names key the held-out split and the eval metrics (eval/<name>/loss): keep them stable.
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)  # shard directory, glob, embedded:<prose|code|math>, prefix
    # grain: share of TOKENS, 0 = eval only; megatron: Megatron's blend weight (share of SAMPLES)
    weight: NonNegativeFloat = 1.0


# `sources: embedded` expands to this: the corpus built offline on first use (corpora/embedded.py).
EMBEDDED_SOURCES = (
    {"name": "prose", "path": "embedded:prose", "weight": 0.5},
    {"name": "code", "path": "embedded:code", "weight": 0.3},
    {"name": "math", "path": "embedded:math", "weight": 0.2},
)


# Megatron's split string: up to three non-negative numbers (train, valid, test), as it parses it.
_MEGATRON_SPLIT = r"\s*[0-9]*\.?[0-9]+\s*(,\s*[0-9]*\.?[0-9]+\s*){0,2}"


class MegatronConfig(_Section):
    """data.kind megatron: Megatron-LM corpora sampled as Megatron's GPTDataset/BlendedDataset
    do (maxtrain/data/megatron/); each key is the Megatron flag of the same name."""

    split: str = "969,30,1"  # --split: train,valid,test shares of each corpus's sequences
    # The end-of-document token id (Megatron's tokenizer.eod); needed by the three switches.
    eod_id: int | None = Field(default=None, ge=0)
    reset_position_ids: bool = False  # positions restart after every EOD
    reset_attention_mask: bool = False  # attention does not cross an EOD
    eod_mask_loss: bool = False  # no loss where the input token is an EOD

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        if not re.fullmatch(_MEGATRON_SPLIT, self.split):
            raise ValueError(
                f"data.megatron.split {self.split!r} is not a Megatron --split: up to three "
                "non-negative numbers (train, valid, test), e.g. 969,30,1"
            )
        if sum(float(x) for x in re.findall(r"[.0-9]+", self.split)) <= 0:
            raise ValueError(f"data.megatron.split {self.split!r} gives every split 0")
        switches = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
        on = [name for name in switches if getattr(self, name)]
        if on and self.eod_id is None:
            raise ValueError(
                f"data.megatron.{on[0]} needs data.megatron.eod_id, the end-of-document token id"
            )
        return self


class DataConfig(_Section):
    kind: Literal["synthetic", "grain", "megatron"] = "synthetic"
    # Synthetic text: each token has this many likely successors, so the loss floor is ~log(it).
    synthetic_branching: int = Field(default=4, gt=0)
    # grain: the weighted mixture of prepared sources; the string "embedded" = EMBEDDED_SOURCES.
    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource(**s) for s in EMBEDDED_SOURCES]
    )
    # the embedded corpus and Megatron index files; None: $MAXTRAIN_CACHE or ~/.cache/maxtrain
    cache_dir: str | None = None
    packing: Literal["concat_then_split", "first_fit"] = "concat_then_split"
    first_fit_bins: int = Field(default=8, gt=0)  # first_fit: open rows per stream (less padding)
    eval_fraction: float = Field(
        default=0.05, ge=0, lt=1, allow_inf_nan=False
    )  # held-out documents per source
    shuffle_seed: int | None = Field(default=None, ge=0)  # None: run.seed
    num_workers: int = Field(default=0, ge=0)  # 0: read in-process; >0: grain worker processes
    worker_buffer_size: int = Field(default=2, ge=0)  # batches buffered per worker (or thread)
    megatron: MegatronConfig = MegatronConfig()

    @model_validator(mode="before")
    @classmethod
    def _expand_embedded(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sources") == "embedded":
            return {**data, "sources": [dict(s) for s in EMBEDDED_SOURCES]}
        return data

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if not self.sources:
            raise ValueError(
                "data.sources is empty; list at least one {name, path, weight} or set "
                "data.sources: embedded"
            )
        names = [s.name for s in self.sources]
        for name in names:
            if not all(c.isalnum() or c in "_.-" for c in name):
                raise ValueError(
                    f"data.sources: name {name!r} may hold only letters, digits, '_', '.' and '-'"
                )
            if names.count(name) > 1:
                raise ValueError(f"data.sources: duplicate source name {name!r}")
        for s in self.sources:
            if s.weight == 0 and self.kind == "megatron":
                raise ValueError(
                    f"data.sources[{s.name}].weight is 0; Megatron's blend takes positive "
                    "weights only"
                )
        if sum(s.weight for s in self.sources) <= 0:
            raise ValueError(
                "data.sources: the weights sum to 0; give at least one source a positive weight"
            )
        return self


class TrainConfig(_Section):
    steps: int = Field(default=300, gt=0)
    global_batch_size: int = Field(default=16, gt=0)  # sequences per optimizer step
    seq_len: int = Field(default=128, gt=0)
    grad_accum_steps: int = Field(default=1, gt=0)
    z_loss: NonNegativeFloat = 0.0
    eval_every: int = Field(default=100, ge=0)  # 0 disables eval
    eval_steps: int = Field(default=4, gt=0)
    log_every: int = Field(default=10, gt=0)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss stops, or skips the update
    # skip: more non-finite steps in a row than this stop the run as `stop` does (a run that
    # skips every step would otherwise go on in silence)
    max_consecutive_skips: int = Field(default=10, gt=0)


class CheckpointTier(_Section):
    dir: str | None = None  # None: <run_dir>/checkpoints/<tier>
    every_steps: int = Field(gt=0)
    keep: int = Field(gt=0)  # newest checkpoints kept
    keep_every_steps: int | None = Field(default=None, gt=0)  # also keep multiples (milestones)


class CheckpointConfig(_Section):
    enabled: bool = True
    local: CheckpointTier = CheckpointTier(every_steps=50, keep=2)
    persistent: CheckpointTier = CheckpointTier(every_steps=500, keep=3)
    load_parameters_path: str | None = None  # start from these params only (fresh optimizer)


class InitConfig(_Section):
    """How a new run turns checkpoint.load_parameters_path into its parameters
    (maxtrain/transforms/). A run resuming from its own checkpoint ignores it: resume wins."""

    # none: the checkpoint holds this model; upcycle: a dense checkpoint becomes this MoE
    # model; depth_upscale: this model's layers are copies of the checkpoint's layers
    mode: Literal["none", "upcycle", "depth_upscale"] = "none"
    source_model: str | None = None  # the checkpoint's model: a file in configs/models/
    noise_std: NonNegativeFloat = 0.0  # upcycle: noise on expert weights, x their RMS
    router_init_std: NonNegativeFloat = 0.0  # upcycle: router kernel std; 0 = zeros
    # depth_upscale: per layer of this model, the source layer it copies; "a..b" = a to b
    layer_map: list[NonNegativeInt] | None = None

    @model_validator(mode="before")
    @classmethod
    def _expand_ranges(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("layer_map"), list):
            return {**data, "layer_map": [i for e in data["layer_map"] for i in _layer_range(e)]}
        return data

    @model_validator(mode="after")
    def _check_mode(self) -> InitConfig:
        if self.mode != "none" and self.source_model is None:
            raise ValueError(
                f"init.mode={self.mode} needs init.source_model: the model of the checkpoint"
            )
        if self.mode == "depth_upscale" and not self.layer_map:
            raise ValueError("init.mode=depth_upscale needs init.layer_map")
        return self


def _layer_range(entry: Any) -> list[Any]:
    """'a..b' -> [a, a + 1, ..., b]; any other entry stays one entry (pydantic checks it)."""
    if not isinstance(entry, str) or ".." not in entry:
        return [entry]
    first, _, last = entry.partition("..")
    if not (first.strip().isdigit() and last.strip().isdigit()) or int(first) > int(last):
        raise ValueError(f"init.layer_map: {entry!r} is not a range a..b of layers with a <= b")
    return list(range(int(first), int(last) + 1))


# Quantized dtypes a rule may name (int4 is meant for weights: too coarse for activations).
QType = Literal["int8", "int4", "float8_e4m3fn", "float8_e5m2"]
# absmax[,s] | minmax[,s] | rms,s | fixed,lo,hi: how a tensor's range (hence scale) is chosen.
_NUM = r"[0-9.eE+-]+"
_CALIBRATION = re.compile(rf"(absmax|minmax)(,{_NUM})?|rms,{_NUM}|fixed,{_NUM},{_NUM}")


class QuantRule(_Section):
    """Quantization of the matmuls in the modules whose path matches `module_path`.

    Paths are module attribute paths joined by '/', e.g. layers/attn/q, layers/mlp/down,
    moe_layers/moe (the experts' grouped matmuls and the router), lm_head; '' is the decoder
    itself (the tied-embedding logits). A qtype left null keeps that operand in compute dtype.
    """

    module_path: str  # regex, matched against the whole path
    op_names: list[Literal["einsum", "dot_general", "ragged_dot"]] = Field(default_factory=list)
    weight_qtype: QType | None = None
    act_qtype: QType | None = None
    bwd_qtype: QType | None = None  # gradients in the backward pass (training only)
    tile_size: int | None = Field(default=None, gt=0)  # sub-channel scales every N inputs
    weight_calibration: str = "absmax"
    act_calibration: str = "absmax"

    @model_validator(mode="after")
    def _check(self) -> QuantRule:
        try:
            re.compile(self.module_path)
        except re.error as e:
            raise ValueError(
                f"quantization.rules: module_path {self.module_path!r} is not a valid regex ({e})"
            ) from None
        for name in ("weight_calibration", "act_calibration"):
            if not _CALIBRATION.fullmatch(getattr(self, name)):
                raise ValueError(
                    f"quantization.rules: {name} {getattr(self, name)!r} is not one of "
                    "absmax[,scale], minmax[,scale], rms,scale, fixed,min,max"
                )
        if self.tile_size is not None and self.op_names == ["ragged_dot"]:
            raise ValueError(
                "quantization.rules: tile_size does not apply to ragged_dot (the experts take "
                "one scale per expert and output channel); drop it or add einsum/dot_general"
            )
        return self


class QuantizationConfig(_Section):
    """Quantized training of the matmuls (maxtrain/quantization/); parameters stay float."""

    preset: Literal["none", "int8", "fp8", "w4a16-serving"] = "none"
    # Checked in order before the preset's own rules: the first rule matching a matmul wins.
    rules: list[QuantRule] = Field(default_factory=list)


class ProfileConfig(_Section):
    start_step: PositiveOrMinusOne = -1  # -1: no profile
    num_steps: int = Field(default=3, gt=0)


class RunConfig(_Section):
    name: str = Field(default="default", min_length=1)
    output_dir: str = "runs"
    seed: NonNegativeInt = 0
    # JAX's persistent compilation cache (maxtrain/cache.py): None = $MAXTRAIN_CACHE or
    # ~/.cache/maxtrain, under compilation/; "" = off.
    compilation_cache_dir: str | None = None


class DistributedConfig(_Section):
    """How this process joins a multi-process run (maxtrain/distributed.py).

    All null: jax detects the cluster (Cloud TPU, SLURM, Open MPI, Kubernetes) when it runs in
    one, else the run is a single process. Any key set is passed on; jax fills in the rest.
    """

    coordinator_address: str | None = None  # "host:port" of process 0's coordinator service
    num_processes: int | None = Field(default=None, gt=0)
    process_id: int | None = Field(default=None, ge=0)
    initialization_timeout_s: int = Field(default=300, gt=0)
    # A process that stops answering for this long is declared dead, and every other process
    # then exits with an error instead of waiting forever in a collective.
    heartbeat_timeout_s: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _check(self) -> DistributedConfig:
        if self.coordinator_address is not None:
            host, _, port = self.coordinator_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"distributed.coordinator_address must be host:port, e.g. 10.0.0.1:1234 "
                    f"(got {self.coordinator_address!r})"
                )
        n, i = self.num_processes, self.process_id
        if n is not None and i is not None and i >= n:
            raise ValueError(
                f"distributed.process_id ({i}) must be below distributed.num_processes ({n})"
            )
        return self


class Config(_Section):
    base_config: str | None = None
    model_name: str
    model: ModelConfig
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    profile: ProfileConfig = ProfileConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    init: InitConfig = InitConfig()
    run: RunConfig = RunConfig()
    distributed: DistributedConfig = DistributedConfig()
    quantization: QuantizationConfig = QuantizationConfig()

    @model_validator(mode="after")
    def _check_train(self) -> Config:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len "
                f"({self.model.max_seq_len})"
            )
        if self.train.global_batch_size % self.train.grad_accum_steps:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be divisible "
                f"by train.grad_accum_steps ({self.train.grad_accum_steps})"
            )
        return self

    @model_validator(mode="after")
    def _check_init(self) -> Config:
        mode, layer_map = self.init.mode, self.init.layer_map
        if mode != "none" and not self.checkpoint.load_parameters_path:
            raise ValueError(
                f"init.mode={mode} needs checkpoint.load_parameters_path: the checkpoint to "
                "start from"
            )
        if mode == "depth_upscale" and len(layer_map or []) != self.model.num_layers:
            raise ValueError(
                f"init.layer_map lists {len(layer_map)} layers, but model.num_layers is "
                f"{self.model.num_layers}"
            )
        return self

    # ---- derived values (computed here once; everything else reads them) -------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.train.steps

    @property
    def micro_batch_size(self) -> int:
        return self.train.global_batch_size // self.train.grad_accum_steps
