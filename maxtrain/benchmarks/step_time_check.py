"""The step-time model (maxtrain/analysis/step_time.py) against step times measured on real chips,
none of which it was fitted to. Prints one JSON line per measurement: where it was published,
the configuration, the measured and predicted seconds per step, and the error.

    python tools/check_step_time.py --maxtext-python MAXTEXT_ENV/bin/python [--only NAME ...]

MaxText's published runs (the tpu-recipes READMEs' `completed step` lines) are compiled with
MaxText's own `train_compile` in its own environment (MaxText is no dependency of maxtrain:
install it beside, as docs/tpu.md says), for the slice the run used, with the settings and the
LIBTPU_INIT_ARGS flag bundle its recipe states, and the model reads the optimized program XLA
dumps. maxtrain's H100 measurements (recipes/h100/README.md) are its recipes compiled for an
H100 without one (`tools/benchmark.py ... --dry-run --compile --topology h100`; needs
`./setup.sh gpu-compiler`). Both compile on a CPU host: the MaxText rows take minutes each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from maxtrain.benchmarks import maxtext
from maxtrain.common.errors import ArgumentParser, UserError, refuse
from maxtrain.config import REPO_ROOT

_RECIPES = "AI-Hypercomputer/tpu-recipes, training/trillium/"
# MaxText's LIBTPU_INIT_ARGS bundles (maxtext/benchmarks/xla_flags_library.py). The recipes' bundle
# also fuses all-gathers into continuation fusions (CF_FOR_ALL_GATHER's
# xla_tpu_enable_async_collective_fusion_fuse_all_gather), which libtpu 0.0.48.1 refuses on
# v6e ("Continuation fusion for AllGather is enabled on platform ghostlite ... not supported"):
# that flag is left out, the all-gathers stay asynchronous (xla_enable_async_all_gather).
_ALL_GATHER_ASYNC = (
    " --xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_multiple_steps=true"
    " --xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
)
_DATA_PARALLEL_OVERLAP = (
    " --xla_tpu_enable_data_parallel_all_reduce_opt=true"
    " --xla_tpu_data_parallel_opt_different_sized_ops=true"
)
_DENSE_BUNDLE = (
    " --xla_tpu_scoped_vmem_limit_kib=98304"  # DENSE_VMEM_LIMIT_FLAG
    " --xla_tpu_use_minor_sharding_for_major_trivial_input=true"  # LAYOUT_FOR_ALL_REDUCE_SCATTER
    " --xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1"
    " --xla_tpu_assign_all_reduce_scatter_layout=true"
    + _DATA_PARALLEL_OVERLAP
    + _ALL_GATHER_ASYNC
    + " --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false"  # SparseCore all-reduce
    " --xla_tpu_enable_sparse_core_collective_offload_all_reduce=true"
    " --xla_tpu_enable_all_reduce_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=true"
    " --xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false"
    " --xla_sc_disable_megacore_partitioning=true"
    " --xla_tpu_enable_all_experimental_scheduler_features=true"  # HOST_OFFLOAD_FLAGS
    " --xla_tpu_enable_scheduler_memory_pressure_tracking=true"
    " --xla_tpu_host_transfer_overlap_limit=24 --xla_tpu_aggressive_opt_barrier_removal=ENABLED"
    " --xla_lhs_prioritize_async_depth_over_stall=ENABLED"
    " --xla_tpu_enable_ag_backward_pipelining=true"
    " --xla_should_allow_loop_variant_parameter_in_chain=ENABLED"
    " --xla_should_add_loop_invariant_op_in_chain=ENABLED"
    " --xla_max_concurrent_host_send_recv=100 --xla_tpu_scheduler_percent_shared_memory_limit=100"
    " --xla_latency_hiding_scheduler_rerun=2"
    " --xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"  # DISABLE_COLLECTIVE_MATMUL
)
_MOE_BUNDLE = " --xla_tpu_scoped_vmem_limit_kib=81920" + _ALL_GATHER_ASYNC + _DATA_PARALLEL_OVERLAP

# The recipes' offloading remat: the layer's input and attention projections kept in the host's
# memory, the rest recomputed; flash attention (splash) with 2048-wide blocks.
_OFFLOAD = {
    "remat_policy": "custom",
    **{key: "offload" for key in ("decoder_layer_input", "out_proj", "query_proj")},
    **{key: "offload" for key in ("key_proj", "value_proj")},
    "attention": "flash",
    "use_iota_embed": "true",
    "ici_fsdp_parallelism": -1,
}
_BLOCKS = {f"sa_block_{k}": 2048 for k in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv")}
_BLOCKS |= {f"sa_block_{k}": 2048 for k in ("kv_dkv_compute", "q_dq", "kv_dq")}
_DENSE = {**_OFFLOAD, **_BLOCKS, "max_target_length": 8192, "sa_use_fused_bwd_kernel": "true"}


@dataclass(frozen=True)
class Measured:
    """One published step time: what ran where, and the log line that reports it."""

    name: str
    source: str
    topology: str
    settings: dict
    libtpu_flags: str
    seconds: float
    reported: str


MAXTEXT = (
    Measured(
        "Llama3.1-8B",
        _RECIPES + "Llama3.1-8B-MaxText/v6e-8/README.md (MaxText tpu-recipes-v0.1.4)",
        "v6e:2x4",
        {"model_name": "llama3.1-8b", "per_device_batch_size": 3, **_DENSE},
        _DENSE_BUNDLE,
        3.443,
        "completed step: 14, seconds: 3.443, TFLOP/s/device: 413.433",
    ),
    Measured(
        "Mistral-7B",
        _RECIPES + "Mistral-7B-MaxText/README.md (MaxText tpu-recipes-v0.1.2)",
        "v6e:2x4",
        {"model_name": "mistral-7b", "per_device_batch_size": 6, **_DENSE},
        _DENSE_BUNDLE,
        6.320,
        "completed step: 6, seconds: 6.320, TFLOP/s/device: 431.981",
    ),
    Measured(
        "Mixtral-8x7B (capacity 1.25)",
        _RECIPES + "Mixtral-8x7B-MaxText/README.md (MaxText tpu-recipes-v0.1.2)",
        "v6e:16x16",
        {
            "model_name": "mixtral-8x7b",
            "per_device_batch_size": 12,
            **_OFFLOAD,
            "max_target_length": 4096,
            **{f"sa_block_{k}": 2048 for k in ("q", "q_dkv", "q_dq")},
            "megablox": "false",
            "sparse_matmul": "false",
            "capacity_factor": 1.25,
            "reuse_example_batch": 1,
        },
        _MOE_BUNDLE,
        13.484,
        "completed step: 11, seconds: 13.484, TFLOP/s/device: 302.311",
    ),
)

# recipes/h100/README.md: one H100 80GB HBM3, measured 2026-11-24 (commit f5b22a6).
H100 = (
    ("dense-1.5b", "recipes/h100/dense-1.5b.yml", 0.2608, "260.8 ms, 491.2 TFLOP/s/device"),
    ("moe-64e", "recipes/h100/moe-64e.yml", 0.2880, "288.0 ms, 142.6 TFLOP/s/device"),
)


def check_maxtext(row: Measured, python: str) -> dict:
    """A MaxText run compiled as its recipe states, timed by the model for its slice."""
    with tempfile.TemporaryDirectory() as dump:
        maxtext.train_compile(
            python,
            row.topology,
            {**row.settings, "dataset_type": "synthetic"},
            libtpu_flags=row.libtpu_flags,
            dump_dir=dump,
        )
        prediction = maxtext.predict(maxtext.optimized_program(dump), row.topology)
    configuration = ", ".join(f"{k}={v}" for k, v in row.settings.items())
    return _row(row.name, row.source, f"{row.topology}: {configuration}", row.seconds, prediction)


def check_maxtrain(name: str, recipe: str, seconds: float, reported: str) -> dict:
    """A maxtrain H100 recipe compiled for an H100 without one, as the benchmark does."""
    command = [
        sys.executable,
        str(REPO_ROOT / "tools" / "benchmark.py"),
        str(REPO_ROOT / recipe),
        "--dry-run",
        "--compile",
        "--topology",
        "h100",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise UserError(f"{recipe}: the compile for an H100 failed:\n{tail}")
    predicted = json.loads(done.stdout.splitlines()[-1])["compiled"]["predicted"]
    return {
        "name": name,
        "source": f"recipes/h100/README.md ({reported})",
        "configuration": f"{recipe} on one H100",
        "measured_s": seconds,
        "predicted_s": predicted["step_s"],
        "error": round(predicted["step_s"] / seconds - 1, 3),
        "bound": predicted["bound"],
        "seconds_by_category": predicted["seconds_by_category"],
    }


def _row(name, source, configuration, seconds, prediction) -> dict:
    return {
        "name": name,
        "source": source,
        "configuration": configuration,
        "measured_s": seconds,
        "predicted_s": round(prediction.seconds, 3),
        "error": round(prediction.seconds / seconds - 1, 3),
        "bound": prediction.bound,
        "seconds_by_category": {k: round(v, 3) for k, v in prediction.breakdown.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="check_step_time", description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext-python", help="python of MaxText's environment")
    names = [row.name for row in MAXTEXT] + [name for name, *_ in H100]
    parser.add_argument("--only", nargs="+", choices=names, help="these rows only")
    args = parser.parse_args(argv)
    wanted = set(args.only or names)
    try:
        maxtext_rows = [row for row in MAXTEXT if row.name in wanted]
        if maxtext_rows and not (args.maxtext_python and Path(args.maxtext_python).is_file()):
            raise UserError("--maxtext-python: the python of MaxText's environment is needed")
        for row in maxtext_rows:
            print(json.dumps(check_maxtext(row, args.maxtext_python)), flush=True)
        for name, recipe, seconds, reported in H100:
            if name in wanted:
                print(json.dumps(check_maxtrain(name, recipe, seconds, reported)), flush=True)
    except UserError as e:
        return refuse("check_step_time", e)
    return 0
