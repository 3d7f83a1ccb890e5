"""CPU with 8 simulated devices for every test, compiling fast (xla_env.py), set before jax is
imported anywhere; and the compilation cache the runs use (maxtrain/training/compile_cache.py) for
the tests' own compilations too, so a program one test compiled loads in the next (tests build
the same tiny models again and again).
"""

import os

from support.xla_env import xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from maxtrain import config as config_lib  # noqa: E402
from maxtrain.training import compile_cache  # noqa: E402

compile_cache.enable_compilation_cache(None)

BASE = config_lib.CONFIGS_DIR / "base.yml"

# Shared fixtures: `setup`, random train states and a Checkpointer factory (tests/checkpointing/).
pytest_plugins = ["support.checkpoints"]


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


# The slow tier: modules that train whole runs (a few steps included), start processes, compile
# for a TPU or run every expert exchange over the 8-device mesh. The rest (unit tests of the
# parts: config, layers, kernels, data, optimizers, analysis) is the fast tier,
# `python -m pytest -m "not slow"`. A test in a fast module that trains or compiles at length is
# marked slow itself (@pytest.mark.slow).
SLOW_MODULES = {
    "test_bad_inputs", "test_benchmark", "test_bubble", "test_checkpoint_compat",
    "test_checkpoint_damage", "test_checkpointing", "test_cli", "test_context_parallel",
    "test_convert_hf", "test_dcn_bytes", "test_depth_upscale", "test_docs_commands",
    "test_evaluate", "test_faults", "test_fine_tuning", "test_generate", "test_gpt_oss",
    "test_grain_multiprocess", "test_grain_pipeline", "test_grpo_runs", "test_indexer_training",
    "test_lora",
    "test_lora_costs", "test_lora_merge", "test_megatron_data", "test_memory", "test_moe",
    "test_moe_dispatch", "test_moe_permutation", "test_mtp", "test_multiprocess_checkpoint",
    "test_muon", "test_muon_deal", "test_pipeline_parallel", "test_pipeline_runs",
    "test_plan_compiles", "test_qk_clip", "test_quantization", "test_resume", "test_run_edges",
    "test_run_identity", "test_schedule_memory", "test_signals", "test_step_program",
    "test_tpu_compile", "test_train_numerics", "test_training", "test_upcycle",
}  # fmt: skip


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def names_in_cache_key():
    """Compilations key JAX's persistent cache by their instructions' names too, which
    maxtrain.analysis.program.grouped_matmuls reads: else a program may come back with those of
    an earlier identical one (say, compiled before the grouped matmul had its name scope)."""
    jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
    yield
    jax.config.update("jax_compilation_cache_include_metadata_in_key", False)
