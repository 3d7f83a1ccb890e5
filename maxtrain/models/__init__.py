"""Models: the decoder (dense and mixture-of-experts layers), built from the config.

models.build(cfg.model)        a freshly initialised decoder (build.py)
models.model_def(cfg)          what the rest of maxtrain runs: apply, after_update, metrics
                               on a params dict (definition.py, auxiliary.py)
models.stacks                  where the layers live in the parameter tree (stacks.py)
models.mtp                     multi-token prediction modules and their loss (mtp.py)
"""

from maxtrain.models.build import (
    abstract,
    active_param_count,
    adapter_count,
    build,
    compute_dtype,
    for_platform,
    param_count,
)
from maxtrain.models.definition import ModelDef, ModelOutput, model_def

__all__ = [
    "ModelDef",
    "ModelOutput",
    "abstract",
    "active_param_count",
    "adapter_count",
    "build",
    "compute_dtype",
    "for_platform",
    "model_def",
    "param_count",
]
