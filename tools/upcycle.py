"""Turns a dense checkpoint into a mixture-of-experts checkpoint (sparse upcycling).

    python tools/upcycle.py CONFIG.yml [key=value ...] --source CKPT --output DIR

CONFIG names the MoE model and its init: section (init.source_model: the dense checkpoint's
model; optional init.noise_std, init.router_init_std); e.g.

    python tools/upcycle.py configs/base.yml model_name=kanana-moe \
        init.source_model=kanana-nano-2.1b --source runs/nano/checkpoints --output ckpt/moe

With a zero router and no noise the result computes the dense model's function exactly
(maxtrain/surgery/upcycle.py says how). Train from it with
`checkpoint.load_parameters_path=DIR`, or skip this tool and set init.mode=upcycle in the run.
"""

from __future__ import annotations

import sys

from maxtrain.surgery.cli import main

if __name__ == "__main__":
    sys.exit(main("upcycle", sys.argv[1:], __doc__.splitlines()[0]))
