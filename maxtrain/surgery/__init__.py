"""Parameter transforms that start a new model from a trained one.

    upcycle(dense_params, dense_cfg, moe_cfg)   dense -> mixture of experts, same function at
                                                step 0 (upcycle.py)
    depth_upscale(params, cfg, layer_map)       a deeper model of copied layers (depth.py)
    initial_params(cfg, target)                 a new run's parameters per the `init:` config
                                                section, from checkpoint.load_parameters_path
                                                (initialize.py; the train loop and the tools)

All work on the plain nested parameter dicts of training/state.py, as pure functions: they run under
jit, on sharded arrays, and on shapes alone (jax.eval_shape), which is how config mistakes are
caught before a checkpoint is read.
"""

from maxtrain.surgery.depth import depth_upscale, solar_layer_map
from maxtrain.surgery.initialize import initial_params
from maxtrain.surgery.upcycle import upcycle

__all__ = ["depth_upscale", "initial_params", "solar_layer_map", "upcycle"]
