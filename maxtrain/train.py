"""`python -m maxtrain.train CONFIG.yml [key=value ...]`: train as the config says.

The loop and what it composes live in maxtrain/training/ (docs/architecture.md); the memory
pre-flight (maxtrain/analysis/preflight.py) and GRPO's rollouts (maxtrain/posttrain/rollout.py,
which sample with maxtrain.inference) sit above training, so they are handed in here.
"""

import sys


def _start() -> int:
    """Imports (jax and the model: seconds), then the loop. A Ctrl-C while importing is one
    line and the shell's 130, as it is later (training/loop.py main), not a traceback."""
    try:
        from maxtrain.analysis.preflight import check_memory
        from maxtrain.posttrain.rollout import on_policy
        from maxtrain.training.loop import main
    except KeyboardInterrupt:
        print("maxtrain: interrupted (SIGINT) while starting; nothing was written", file=sys.stderr)
        return 130
    return main(preflight=check_memory, on_policy=on_policy)


if __name__ == "__main__":
    sys.exit(_start())
