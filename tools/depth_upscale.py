"""Builds a deeper model from a checkpoint by copying its layers (depth upscaling).

    python tools/depth_upscale.py CONFIG.yml [key=value ...] --source CKPT --output DIR

CONFIG names the deeper model and its init: section (init.source_model: the checkpoint's model;
init.layer_map: per new layer, the source layer it copies, "a..b" for a range); e.g. SOLAR-style
from 32 to 48 layers:

    python tools/depth_upscale.py configs/base.yml model_name=llama3-8b
    model.num_layers=48 \
        init.source_model=llama3-8b 'init.layer_map=[0..23,8..31]' --source CKPT --output DIR

Copied layers are bit-identical to their sources. Train from the result with
`checkpoint.load_parameters_path=DIR`, or skip this tool and set init.mode=depth_upscale in
the run (configs/kanana-9.1b-dus.yml).
"""

from __future__ import annotations

import sys

from maxtrain.surgery.cli import main

if __name__ == "__main__":
    sys.exit(main("depth_upscale", sys.argv[1:], __doc__.splitlines()[0]))
