"""The config schema: every key a run config may hold, its type, default and checks, and the values
derived from others (head_dim, global batch in tokens, parallel degrees), computed once, here, and
nowhere else. Each section lives in a module of its own (model.py with rope.py, moe.py and
layer_list.py; compute.py, parallel.py, optim.py, data.py, run.py, checkpoint.py, quantization.py,
lora.py); this module composes them into the one Config. How a config is assembled from files and
overrides is loading.py.

Every key declares its domain where it is declared: its type, its bounds (`Field(gt=...)` or
the named types of domains.py), its choices (`Literal`), and finiteness: every float is finite
(`allow_inf_nan=False`). A value outside it is refused by pydantic, and loading.py turns that
into one line naming the key, the value and the domain; tests/config/test_config_domains.py
walks the schema and tries a value outside every declared domain. Checks that involve several
keys are the validators.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from maxtrain.config.checkpoint import CheckpointConfig, InitConfig
from maxtrain.config.compute import ComputeConfig, named_tiles
from maxtrain.config.data import DataConfig
from maxtrain.config.domains import Section
from maxtrain.config.lora import LoraConfig
from maxtrain.config.model import ModelConfig
from maxtrain.config.optim import OptimConfig
from maxtrain.config.parallel import IN_SCHEDULE, MeshConfig, PipelineConfig
from maxtrain.config.quantization import QuantizationConfig
from maxtrain.config.run import DistributedConfig, ProfileConfig, RunConfig, TrainConfig


class Config(Section):
    base_config: str | None = None
    model_name: str
    model: ModelConfig
    compute: ComputeConfig = ComputeConfig()
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
    lora: LoraConfig = LoraConfig()

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
    def _check_task(self) -> Config:
        """sft trains on chat sources, dpo only on preference pairs, which nothing else reads."""
        formats = {s.format for s in self.data.sources if s.weight > 0}
        if self.train.task == "sft" and "chat" not in formats:
            raise ValueError(
                "train.task=sft needs a data.sources entry with format: chat (a JSONL file of "
                "conversations)"
            )
        if (self.train.task == "dpo") != (formats == {"preference"}):
            raise ValueError(
                f"train.task={self.train.task} with data.sources of format "
                f"{', '.join(sorted(formats))}: train.task=dpo trains on format: preference "
                "sources only, and only it reads them"
            )
        if (self.train.task == "grpo") != (formats == {"prompts"}):
            raise ValueError(
                f"train.task={self.train.task} with data.sources of format "
                f"{', '.join(sorted(formats))}: train.task=grpo samples from format: prompts "
                "sources only, and only it reads them"
            )
        grpo = self.train.grpo
        if self.train.task == "grpo" and self.train.global_batch_size % grpo.group_size:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be a multiple "
                f"of train.grpo.group_size ({grpo.group_size}): each prompt's completions fill "
                "a group of rows"
            )
        if (
            self.train.task == "grpo"
            and grpo.kl != "none"
            and not self.checkpoint.load_parameters_path
        ):
            raise ValueError(
                f"train.grpo.kl={grpo.kl} needs checkpoint.load_parameters_path: the model to "
                "tune, the reference the penalty measures the policy against"
            )
        if self.train.task == "dpo" and not self.checkpoint.load_parameters_path:
            raise ValueError(
                "train.task=dpo needs checkpoint.load_parameters_path: the model to tune, whose "
                "frozen copy is the reference"
            )
        return self

    @model_validator(mode="after")
    def _check_experts(self) -> Config:
        moe = self.model.moe
        if moe is None:
            return self
        if moe.expert_projection_bias and self.compute.expert_exchange_overflow == "drop":
            raise ValueError(
                "model.moe.expert_projection_bias needs every routed assignment computed: "
                "compute.expert_exchange_overflow rounds, not drop"
            )
        quantized = self.quantization.preset != "none" or self.quantization.rules
        if quantized and named_tiles(self.compute.grouped_matmul_tiles):
            raise ValueError(
                "compute.grouped_matmul_tiles tiles the float grouped matmul, but quantized "
                "training runs tokamax's quantized kernel on its own tiles: set "
                "compute.grouped_matmul_tiles={} or quantization.preset=none"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> Config:
        if not self.lora.enabled:
            return self
        if not self.checkpoint.load_parameters_path:
            raise ValueError(
                f"lora.rank={self.lora.rank} needs checkpoint.load_parameters_path: the base "
                "model the adapters are trained on"
            )
        if "experts" in self.lora.modules and self.model.moe is None:
            raise ValueError(
                "lora.modules lists experts, but this model has no routed experts (model.moe "
                "is unset); adapt attention and/or mlp"
            )
        if self.quantization.preset != "none" or self.quantization.rules:
            raise ValueError(
                "lora.rank > 0 with quantization: set: quantized training and adapters "
                "intercept the same matmuls; for a quantized base use lora.base_quantization"
            )
        return self

    @model_validator(mode="after")
    def _check_qk_clip(self) -> Config:
        """QK-clip rescales the attention layers of the decoder's stacks from the xla kernel's
        max logits (models/qk_clip.py); what it cannot see or whose logits its rescale does not
        move is refused here."""
        tau = self.optim.qk_clip_threshold
        key = f"optim.qk_clip_threshold={tau}" if tau is not None else ""
        if not key and not self.compute.attention_max_logit:
            return self
        key = key or "compute.attention_max_logit=true"
        if self.compute.attention not in ("auto", "xla"):
            raise ValueError(
                f"{key} needs each attention head's max logit, which only compute.attention=xla "
                f"computes, not compute.attention={self.compute.attention}"
            )
        if self.mesh.context != 1 or self.mesh.dcn.context != 1:
            raise ValueError(f"{key} needs mesh.context=1: split attention gives no max logit")
        if self.mesh.stage * self.mesh.dcn.stage > 1:
            raise ValueError(f"{key} does not work with pipeline stages (mesh.stage > 1)")
        if tau is None:
            return self
        problems = {
            f"model.qk_norm={self.model.qk_norm} (the norm undoes a rescale of the weights "
            "before it)": self.model.qk_norm != "none",
            "lora (the query and key weights are frozen)": self.lora.enabled,
            "model.mtp.depth > 0 (its block's attention is not clipped)": self.model.mtp.depth > 0,
        }
        for problem, present in problems.items():
            if present:
                raise ValueError(f"{key} does not work with {problem}; unset one of them")
        return self

    @model_validator(mode="after")
    def _check_indexer(self) -> Config:
        """DeepSeek sparse attention (model.mla.indexer): its warm-up trains the indexers on
        a frozen model it must be given; what its layers do not report or combine with is
        refused."""
        indexer = self.model.mla.indexer if self.model.mla else None
        if indexer is None:
            return self
        warmup = indexer.stage == "warmup"
        if warmup and not self.checkpoint.load_parameters_path:
            raise ValueError(
                "model.mla.indexer.stage=warmup needs checkpoint.load_parameters_path: the "
                "model whose attention the indexer learns, held frozen"
            )
        problems = {
            "optim.qk_clip_threshold or compute.attention_max_logit (its layers report no max "
            "logit)": self.optim.qk_clip_threshold is not None or self.compute.attention_max_logit,
            "pipeline stages (mesh.stage > 1)": self.mesh.stage * self.mesh.dcn.stage > 1,
            "lora, in the warm-up (which trains the indexers alone)": warmup and self.lora.enabled,
        }
        for problem, present in problems.items():
            if present:
                raise ValueError(f"model.mla.indexer does not work with {problem}")
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> Config:
        """A schedule that runs the backward itself (parallel/scheduled.py) takes each
        micro-batch's next-token loss on the last stage and differentiates every stage's
        weights there: what needs more of the model than one micro-batch's logits, or frozen
        weights, is refused."""
        schedule = self.pipeline.schedule
        if schedule not in IN_SCHEDULE or self.mesh.stage * self.mesh.dcn.stage == 1:
            return self
        problems = {
            f"train.task={self.train.task} (its objective reads whole logits: gpipe or "
            "circular run it)": self.train.task not in ("pretrain", "sft"),
            "model.mtp.depth > 0 (the prediction modules read the last layer and the "
            "embeddings of the whole batch)": self.model.mtp.depth > 0,
            "lora (the schedule trains every stage weight)": self.lora.enabled,
        }
        for problem, present in problems.items():
            if present:
                raise ValueError(f"pipeline.schedule={schedule} does not work with {problem}")
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
    def schedule_steps(self) -> int:
        """Steps the learning-rate schedule spans: optim.schedule_steps, else train.steps."""
        return self.optim.schedule_steps or self.train.steps

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.train.steps

    @property
    def micro_batch_size(self) -> int:
        return self.train.global_batch_size // self.train.grad_accum_steps
