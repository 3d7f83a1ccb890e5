"""CPU with 8 simulated devices for every test, compiling fast (xla_env.py), set before jax is
imported anywhere; and the compilation cache the runs use (maxtrain/cache.py) for the tests' own
compilations too, so a program one test compiled loads in the next (tests build the same tiny
models again and again).
"""

import os

from xla_env import xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from maxtrain import cache  # noqa: E402
from maxtrain import config as config_lib  # noqa: E402

cache.enable_compilation_cache(None)

BASE = config_lib.CONFIGS_DIR / "base.yml"


@pytest.fixture
def make_cfg(tmp_path: Path):
    """make_cfg("key=value", ...) -> Config for the tiny model, writing into tmp_path."""

    def make(*overrides: str) -> config_lib.Config:
        defaults = (
            "model_name=tiny",
            "data.kind=synthetic",  # tiny's vocab (256) is below the embedded tokenizer's
            f"run.output_dir={tmp_path}",
            "train.steps=4",
            "train.global_batch_size=8",
            "train.seq_len=32",
            "train.eval_every=0",
            "optim.warmup_steps=1",
        )
        return config_lib.load(BASE, [*defaults, *overrides])

    return make
