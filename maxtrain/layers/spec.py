"""What every layer is built from: the architecture (`model:`), how this run computes it
(`compute:`, its "auto" choices made for the devices' platform by models/build.py
platform_choices) and the std of the initial weights (`init.std`), in one frozen object.

Layers take one ModelSpec and read `spec.model` for what they compute and `spec.compute` for
how; none sees the run's whole Config. training/run_model.py builds the run's once; a model
built for its shapes alone (parameter counts, Hugging Face conversion) takes the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ComputeConfig, InitConfig, ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype_name(name: str, platform: str | None = None) -> str:
    """compute.compute_dtype for a platform (None: this process's default backend): "auto" is
    float32 on CPU (where bfloat16 is emulated, slowly), bfloat16 on accelerators."""
    if name == "auto":
        return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"
    return name


@dataclass(frozen=True)
class ModelSpec:
    model: ModelConfig
    compute: ComputeConfig = ComputeConfig()
    init_std: float = InitConfig.model_fields["std"].default

    @property
    def param_dtype(self) -> jnp.dtype:
        return DTYPES[self.compute.param_dtype]

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[compute_dtype_name(self.compute.compute_dtype)]

    def projection(self, rngs: nnx.Rngs) -> dict[str, Any]:
        """The keyword arguments of a Projection (layers/base.py) under this spec."""
        return dict(
            init_std=self.init_std,
            param_dtype=self.param_dtype,
            compute_dtype=self.compute_dtype,
            rngs=rngs,
        )
