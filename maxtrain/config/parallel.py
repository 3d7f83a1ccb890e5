"""The `mesh:` and `pipeline:` sections: how the devices are arranged and the layers staged."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import PositiveInt, PositiveOrMinusOne, Section

MESH_AXES = ("data", "stage", "fsdp", "context", "tensor", "expert")
MeshAxis = Literal[MESH_AXES]


class MeshAxes(Section):
    """Degree of each mesh axis; -1 means 'the devices that remain' (at most one -1)."""

    data: PositiveOrMinusOne = 1
    stage: PositiveInt = 1  # given, never -1: the stages split the model's layers
    fsdp: PositiveOrMinusOne = -1
    context: PositiveOrMinusOne = 1
    tensor: PositiveOrMinusOne = 1
    expert: PositiveOrMinusOne = 1


class DcnAxes(Section):
    """Degree of each mesh axis across slices (data-center network); the product = num_slices."""

    data: PositiveInt = 1
    stage: PositiveInt = 1
    fsdp: PositiveInt = 1
    context: PositiveInt = 1
    tensor: PositiveInt = 1
    expert: PositiveInt = 1


# Logical axis name -> the mesh axes it is sharded over. Layer code names only logical axes.
DEFAULT_RULES: dict[str, list[str]] = {
    "batch": ["data", "fsdp", "expert"],  # activation batch dim: every data-parallel axis
    "stage_batch": ["data", "stage", "fsdp", "expert"],  # the head's batch: stages split it too
    "length": ["context"],  # activation sequence dim
    "act_embed": [],  # activation embedding dim (replicated)
    "embed": ["fsdp"],  # parameter embedding dim: FSDP shards it
    "latent": ["fsdp"],  # multi-head latent attention's low-rank dims
    "lora_rank": ["fsdp"],  # adapters' rank dim, where the adapter's other dim is not split
    "vocab": ["tensor"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": [],
    "mlp": ["tensor"],  # MLP hidden dim, dense and expert
    "exp": ["expert"],  # MoE expert dim (also in batch: tokens move by all-to-all)
    "norm": [],
    "layers": ["stage"],  # the stacked-layers axis: pipeline stages hold their layers
    "stages": ["stage"],  # the stage axis of pipelined parameters
    "repeats": [],  # a pipeline stage's blocks of layers (circular schedule)
}


class MeshConfig(MeshAxes):
    """The device mesh: each axis's degree within and across slices, and the sharding rules."""

    num_slices: int = Field(default=1, gt=0)
    dcn: DcnAxes = DcnAxes()
    rules: dict[str, list[MeshAxis]] = Field(default_factory=lambda: dict(DEFAULT_RULES))


# Schedules that run the backward themselves (parallel/scheduled.py); gpipe and circular are
# the automatic derivative of their forward.
IN_SCHEDULE = frozenset({"1f1b", "interleaved_1f1b", "zero_bubble"})


class PipelineConfig(Section):
    """Pipeline parallelism over mesh.stage x mesh.dcn.stage stages (parallel/pipeline.py,
    the schedules: parallel/schedules.py and docs/pipeline.md)."""

    # gpipe: each stage holds one block of consecutive layers, every forward then every
    # backward; circular: `repeats` blocks per stage, spread over the depth, so the idle share
    # (S - 1) / (R * M + S - 1) shrinks with R; 1f1b: each micro-batch's backward as soon as
    # its forward ends, at most 2S - 1 micro-batches' activations kept whatever M;
    # interleaved_1f1b: 1f1b over `repeats` blocks per stage (M a multiple of S); zero_bubble:
    # ZB-H1, 1f1b with the weight gradients deferred into the ticks where every stage has one.
    schedule: Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble"] = "gpipe"
    microbatches: int | None = Field(default=None, gt=0)  # M per step; null: the stage count
    repeats: int = Field(default=1, gt=0)  # circular, interleaved_1f1b: layer blocks per stage

    @model_validator(mode="after")
    def _check_schedule(self) -> PipelineConfig:
        if self.repeats != 1 and self.schedule not in ("circular", "interleaved_1f1b"):
            raise ValueError(
                f"pipeline.repeats={self.repeats} needs pipeline.schedule=circular or "
                f"interleaved_1f1b ({self.schedule} holds one block of layers per stage)"
            )
        return self
