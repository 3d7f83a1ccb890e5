"""Turns a dense checkpoint into a mixture-of-experts checkpoint (sparse upcycling).

    python tools/upcycle.py CONFIG.yml [key=value ...] --source CKPT --output DIR

CONFIG names the MoE model and its init: section (init.source_model: the dense checkpoint's
model; optional init.noise_std, init.router_init_std); e.g.

    python tools/upcycle.py configs/base.yml model_name=kanana-moe \
        init.source_model=kanana-nano-2.1b --source runs/nano/checkpoints --output ckpt/moe

With a zero router and no noise the result computes the dense model's function exactly
(maxtrain/transforms/upcycle.py says how). Train from it with
`checkpoint.load_parameters_path=DIR`, or skip this tool and set init.mode=upcycle in the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxtrain.transforms.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("upcycle", sys.argv[1:], __doc__.splitlines()[0]))
