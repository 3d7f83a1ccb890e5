"""The `checkpoint:` tiers and the `init:` section (how a new run's parameters start)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, NonNegativeInt, Section


class CheckpointTier(Section):
    dir: str | None = None  # None: <run_dir>/checkpoints/<tier>
    every_steps: int = Field(gt=0)
    keep: int = Field(gt=0)  # newest checkpoints kept
    keep_every_steps: int | None = Field(default=None, gt=0)  # also keep multiples (milestones)


class CheckpointConfig(Section):
    """Checkpoints in two tiers (local: often, few kept; persistent: the durable ones), and
    the parameters a new run starts from (maxtrain/checkpointing/)."""

    enabled: bool = True
    local: CheckpointTier = CheckpointTier(every_steps=50, keep=2)
    persistent: CheckpointTier = CheckpointTier(every_steps=500, keep=3)
    load_parameters_path: str | None = None  # start from these params only (fresh optimizer)


class InitConfig(Section):
    """How a new run's parameters start: drawn at random, or from
    checkpoint.load_parameters_path as it is or transformed (maxtrain/surgery/). A run
    resuming from its own checkpoint ignores it: resume wins."""

    std: NonNegativeFloat = 0.02  # std of the truncated-normal draw of kernels and embeddings
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
