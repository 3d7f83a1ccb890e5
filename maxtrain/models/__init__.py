"""The model: the decoder (dense and mixture-of-experts layers), built from a ModelSpec (the
architecture, `model:`, and how it is computed, `compute:`; layers/spec.py).

model.build(spec)              a freshly initialised decoder (build.py)
model.define(module, spec)     what the rest of maxtrain runs: apply, after_update, metrics
                               on a params dict (definition.py, router_training.py)
model.stacks                   where the layers live in the parameter tree (stacks.py)
model.mtp                      multi-token prediction modules and their loss (mtp.py)

The model knows nothing of the run: the run's model (pipeline stages, adapters, quantized
matmuls, the platform's kernels) is composed in training/run_model.py.
"""

from maxtrain.layers.spec import ModelSpec
from maxtrain.models.build import (
    abstract,
    active_param_count,
    build,
    compute_dtype,
    embedding_lookup_params,
    param_count,
    platform_choices,
)
from maxtrain.models.definition import ModelDef, ModelOutput, combine_stats, define, no_stats

__all__ = [
    "ModelDef",
    "ModelOutput",
    "ModelSpec",
    "abstract",
    "active_param_count",
    "build",
    "combine_stats",
    "compute_dtype",
    "define",
    "embedding_lookup_params",
    "no_stats",
    "param_count",
    "platform_choices",
]
