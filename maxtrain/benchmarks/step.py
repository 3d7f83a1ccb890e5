"""Times the train step of a config and prints one JSON line.

    python tools/benchmark.py CONFIG.yml [key=value ...] [--steps N] [--warmup W]
    python tools/benchmark.py CONFIG.yml [key=value ...] --dry-run [--devices N]
    [--compile]

Compiles the step (compile_s), runs W warm-up steps, then N timed steps, each synchronised so
the median is a true per-step time. It also prints the bytes each kind of collective moves per
device and step, read from the compiled program, and for an MoE the routed rows' bytes beside
them (with several slices, those whose groups cross slices again as "dcn <kind>": the
traffic on the data-center network). One synthetic batch is reused, so the figure is the model
step alone, not the input pipeline. FLOPs are model FLOPs (training/loop.py's count), never the
recomputation remat adds. With pipeline stages, the schedule's idle share (bubble) too.

--dry-run runs nothing: the memory estimate per device (maxtrain/analysis/memory.py), and
whether it fits the memory of the device named by --device (default: this host's; HBM per
chip in maxtrain/common/devices.py) and by how much (`fit`); with lora.rank > 0 also what
trains and what the frozen base costs, beside full fine-tuning (`lora`). With
--compile it also compiles the step for a state of shapes only (nothing allocated), so a model
far bigger than this host compiles on simulated CPU devices, and prints what the compiled
program says: XLA's memory per device and the collective bytes, DCN apart; compiled for a TPU
or GPU topology (--topology), also the step time it predicts on that chip (`predicted`,
maxtrain/analysis/step_time.py). For 512 devices:
XLA_FLAGS=--xla_force_host_platform_device_count=512 python tools/benchmark.py ...
--dry-run
--compile.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from maxtrain import config as config_lib
from maxtrain import models as model_lib
from maxtrain.analysis import collectives, memory, program, step_time, transfers
from maxtrain.analysis.preflight import host_memory_bytes
from maxtrain.common import devices as devices_lib
from maxtrain.common import files
from maxtrain.common.errors import (
    ArgumentParser,
    UserError,
    non_negative_int,
    path_first,
    positive_int,
    refuse,
)
from maxtrain.data import to_global
from maxtrain.data.streams import data_streams
from maxtrain.kernels.grouped_matmul import grouped_matmul_implementation
from maxtrain.models.stacks import is_moe_per_layer
from maxtrain.parallel.context import attention_pairs
from maxtrain.parallel.expert_exchanges import exchange_implementation
from maxtrain.parallel.mesh import axis_sizes, batch_degree, device_slices
from maxtrain.parallel.topology import topology_devices
from maxtrain.training import metrics, run_model
from maxtrain.training.compile_progress import compile_progress, devices_of
from maxtrain.training.run_model import stage_layout
from maxtrain.training.trainer import build_trainer, check_batch, compile_step


def peak_memory_gib() -> float | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def moe_settings(cfg: config_lib.Config) -> dict:
    """The MoE choices that decide its speed (none for a dense model)."""
    moe, compute = cfg.model.moe, cfg.compute
    if moe is None:
        return {}
    return {
        "experts": f"{moe.num_experts} top-{moe.top_k}",
        "grouped_matmul": grouped_matmul_implementation(compute.grouped_matmul),
        "moe_mode": "dropless" if moe.expert_capacity_factor is None else "capacity",
        "expert_exchange": exchange_implementation(compute.expert_exchange),
        "expert_exchange_overflow": compute.expert_exchange_overflow,
    }


def routing_measured(cfg: config_lib.Config, step_metrics: dict) -> dict:
    """Under which routing the step was timed (an MoE's speed depends on it): learned, or the
    balanced diagnostic (compute.balanced_routing), with the last timed step's busiest
    expert's load relative to fair (1.0 = balanced), the exchange rounds its busiest buffer
    needed, and the share of assignments dropped."""
    if cfg.model.moe is None:
        return {}
    return {
        "routing": "balanced (diagnostic)" if cfg.compute.balanced_routing else "learned",
        "moe_max_load": round(float(step_metrics["moe/max_load"]), 3),
        "moe_rounds": int(step_metrics["moe/rounds"]),
        "moe_dropped": round(float(step_metrics.get("moe/dropped", 0.0)), 5),
    }


def pipeline_settings(cfg: config_lib.Config) -> dict:
    """The pipeline schedule and its idle share per step (none without stages)."""
    layout = stage_layout(cfg)
    if layout is None:
        return {}
    return {
        "pipeline": {
            "schedule": cfg.pipeline.schedule,
            "stages": layout.stages,
            "repeats": layout.repeats,
            "microbatches": layout.microbatches,
            "bubble": round(layout.bubble, 4),
        }
    }


def lora_settings(cfg: config_lib.Config, estimate: memory.MemoryEstimate, devices: int) -> dict:
    """With lora.rank > 0: the adapters (what trains); the factor by which the whole model's
    optimizer state and checkpoint shrink (parameters over adapters); the frozen base's bytes
    per device as stored (quantized under lora.base_quantization); and the optimizer state per
    device beside full fine-tuning's (the same config with lora.rank 0), a smaller factor
    where the mesh splits the adapters less than the kernels. None without LoRA."""
    lora = cfg.lora
    if not lora.enabled:
        return {}
    from maxtrain.posttrain.lora import adapter_count  # Qwix takes seconds to import

    trained = adapter_count(cfg.model, lora)
    full_cfg = cfg.model_copy(update={"lora": lora.model_copy(update={"rank": 0})})
    full = memory.estimate(full_cfg, devices)
    return {
        "lora": {
            "rank": lora.rank,
            "modules": lora.modules,
            "base_quantization": lora.base_quantization,
            "trained_params": trained,
            "whole_model_state_factor": round(model_lib.param_count(cfg.model) / trained, 2),
            "frozen_bytes_per_device": estimate.frozen,
            "optimizer_bytes_per_device": estimate.optimizer,
            "full_fine_tuning_optimizer_bytes_per_device": full.optimizer,
            "optimizer_factor_per_device": round(full.optimizer / estimate.optimizer, 2),
            "full_fine_tuning_total_gib_per_device": full.as_gib()["total"],
        }
    }


def context_settings(cfg: config_lib.Config, context: int) -> dict:
    """The context-parallel exchange and each layout's forward attention FLOPs per device and
    layer for one sequence (causal, one document): max / min over the devices (none at C = 1)."""
    if context == 1:
        return {}
    model = cfg.model
    per_pair = 4 * model.num_heads * model.resolved_head_dim  # QK^T and PV, 2 FLOPs per MAC

    def flops(layout: str) -> dict:
        pairs = attention_pairs(cfg.train.seq_len, context, layout)
        return {"max": per_pair * max(pairs), "min": per_pair * min(pairs),
                "max_over_min": round(max(pairs) / min(pairs), 4)}  # fmt: skip

    return {
        "context": {
            "degree": context,
            "exchange": cfg.compute.context_exchange,
            "layout": cfg.compute.context_layout,
            "attention_flops_per_device_layer": {
                layout: flops(layout) for layout in ("balanced", "contiguous")
            },
        }
    }


def program_collectives(cfg: config_lib.Config, trainer, compiled) -> dict[str, int]:
    """Bytes per collective kind per device and step, those crossing slices under "dcn ..."."""
    slices = device_slices(trainer.mesh, cfg.mesh.num_slices) if cfg.mesh.num_slices > 1 else None
    return collectives.collective_bytes(compiled.as_text(), slices)


def routed_bytes(cfg: config_lib.Config, trainer) -> dict:
    """One device's routed rows per step, one way (to the experts): what an expert-parallel
    exchange must move at least, to set beside `collective_bytes` (none for a dense model)."""
    m = cfg.model.moe
    if m is None:
        return {}
    tokens = cfg.tokens_per_step // batch_degree(cfg.mesh.rules, trainer.mesh)
    moe_layers = sum(is_moe_per_layer(cfg.model))
    itemsize = jnp.dtype(model_lib.compute_dtype(cfg.compute)).itemsize
    return {
        "moe_routed_bytes_one_way": moe_layers * tokens * m.top_k * cfg.model.emb_dim * itemsize
    }


def matmul_dtypes(trainer, batch) -> dict[str, int]:
    """The operand dtypes of the train step's matmuls, forward and backward, with how often
    each occurs in the traced program: what quantization: really changed (and what not)."""
    counts = program.matmul_dtypes(trainer.step_fn, trainer.state, batch)
    return {f"{op} {' x '.join(dtypes)}": n for (op, dtypes), n in sorted(counts.items())}


def benchmark(cfg: config_lib.Config, steps: int, warmup: int, profile_dir: str | None) -> dict:
    host_batch = next(data_streams(cfg)[0])  # data mistakes first: they need no compiling
    trainer = build_trainer(cfg)
    batch = to_global(host_batch, trainer.batch_sharding)
    dtypes = matmul_dtypes(trainer, batch)  # traced before the steps donate the state
    t0 = time.perf_counter()
    with _compile_progress(cfg, trainer):
        step = trainer.step_fn.lower(trainer.state, batch).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        trainer.state, step_metrics = step(trainer.state, batch)
        jax.block_until_ready(step_metrics)
        times.append(time.perf_counter() - t0)
    first_step, times = times[0], times[warmup:]
    step_time = statistics.median(times)
    if profile_dir:  # two more steps under the profiler, after timing so it costs nothing there
        with jax.profiler.trace(profile_dir):
            for _ in range(2):
                trainer.state, step_metrics = step(trainer.state, batch)
            jax.block_until_ready(step_metrics)
    device_kind = jax.devices()[0].device_kind
    stats = metrics.step_stats(
        step_time,
        cfg.tokens_per_step,
        trainer.mesh.size,
        trainer.flops_per_token,
        metrics.peak_tflops(device_kind),
    )
    return {
        "model": cfg.model_name,
        "device": device_kind,
        "devices": trainer.mesh.size,
        "total_params": model_lib.param_count(cfg.model),
        "active_params": model_lib.active_param_count(cfg.model),  # what FLOPs and MFU count
        "global_batch": cfg.train.global_batch_size,
        "seq_len": cfg.train.seq_len,
        "attention": cfg.compute.attention,
        "remat": cfg.compute.remat,
        **moe_settings(cfg),
        **pipeline_settings(cfg),
        **context_settings(cfg, trainer.mesh.shape["context"]),
        "quantization": cfg.quantization.preset,
        "matmul_dtypes": dtypes,
        # Per device and step, from the compiled program (maxtrain/analysis/program.py).
        "collective_bytes": program_collectives(cfg, trainer, step),
        **routed_bytes(cfg, trainer),
        # The bytes the step reads and writes, each loop trip counted (XLA's own count takes a
        # scan's body once: one layer of a scanned stack), and the copies it makes of the state
        # it is handed (donated: a copy is memory traffic the math did not ask for).
        "bytes_accessed_mb": round(program.bytes_accessed(step.as_text()) / 1e6, 1),
        "state_copied_mb": round(
            sum(b for _, b in program.entry_parameter_copies(step.as_text())) / 1e6, 3
        ),
        "compile_s": round(compile_s, 2),
        "first_step_s": round(first_step, 2),
        "median_step_s": round(step_time, 5),
        "min_step_s": round(min(times), 5),
        "tokens_per_sec_per_device": round(stats["tokens_per_sec_per_device"], 1),
        "tflops_per_device": round(stats["tflops_per_device"], 2),
        "mfu": None if stats["mfu"] is None else round(stats["mfu"], 4),
        **routing_measured(cfg, step_metrics),
        "peak_memory_gib": peak_memory_gib(),
        "final_loss": float(step_metrics["loss"]),
    }


def _compile_progress(cfg: config_lib.Config, trainer):
    """Lines on stderr while the step compiles (minutes on a TPU slice); stdout is the JSON."""
    say = functools.partial(print, file=sys.stderr, flush=True)
    what = f"the train step of {cfg.model_name}"
    return compile_progress(what, devices_of(trainer.mesh), say)


def _fit(estimate_gib: float, device_kind: str, num_devices: int) -> dict[str, object]:
    """memory.fit for an accelerator; on CPU, this host's RAM shared by the run's devices (the
    simulated devices of one process: analysis/preflight.py), where it is known."""
    if devices_lib.platform(device_kind) != "cpu" or (host := host_memory_bytes()) is None:
        return memory.fit(estimate_gib, device_kind)
    per_device = host / 2**30 / num_devices
    return {
        "device": f"{device_kind} (host RAM shared by {num_devices} devices)",
        "device_memory_gib": round(per_device, 3),
        "fits": estimate_gib <= per_device,
        "headroom_gib": round(per_device - estimate_gib, 3),
    }


def dry_run(
    cfg: config_lib.Config,
    num_devices: int,
    compile_step: bool,
    device_kind: str,
    devices: tuple[jax.Device, ...] | None = None,
    hlo_path: str | None = None,
) -> dict:
    """The memory estimate for `num_devices` devices, in GiB per device, and whether it fits a
    device of `device_kind` (its memory, and the headroom or shortfall); with compile_step,
    what the step compiled for `devices` (default: this host's) says (see the module
    docstring). Choices that depend on the hardware (kernels, compute dtype) are made for the
    platform of `device_kind`, as a run there would make them."""
    cfg = run_model.for_platform(
        cfg, devices_lib.platform(device_kind), device_kind, num_devices // cfg.mesh.num_slices
    )
    sizes = axis_sizes(cfg.mesh, num_devices)
    check_batch(cfg, AbstractMesh(tuple(sizes.values()), tuple(sizes)))  # as the run would
    estimate = memory.estimate(cfg, num_devices)
    estimated = estimate.as_gib()
    result = {
        "model": cfg.model_name,
        "devices": num_devices,
        "mesh": {k: v for k, v in sizes.items() if v > 1},
        "total_params": model_lib.param_count(cfg.model),
        "active_params": model_lib.active_param_count(cfg.model),
        # the convention of OpenAI's and DeepSeek's published active counts
        "active_params_without_embedding": model_lib.active_param_count(cfg.model)
        - model_lib.embedding_lookup_params(cfg.model),
        "compute_dtype": cfg.compute.compute_dtype,
        "attention": cfg.compute.attention,
        "remat": cfg.compute.remat,
        **moe_settings(cfg),
        **pipeline_settings(cfg),
        **context_settings(cfg, sizes["context"]),
        **lora_settings(cfg, estimate, num_devices),
        "estimated_gib_per_device": estimated,
        "fit": _fit(estimated["total"], device_kind, num_devices),
    }
    if compile_step:
        result["compiled"] = compiled_program(cfg, estimated["total"], devices, hlo_path)
    return result


def compiled_program(
    cfg: config_lib.Config,
    estimated_gib: float,
    devices: tuple[jax.Device, ...] | None,
    hlo_path: str | None = None,
) -> dict:
    """The step compiled for `devices` (this host's by default, or a TPU topology's) from
    shapes alone, and what the compiler says of it, per device: its memory (arguments,
    outputs, the part of them aliased by the donated state, temporaries, and the peak they add
    up to), FLOPs and bytes accessed, the collectives' bytes by mesh axes (ICI and DCN apart),
    the hand-written kernels in the program, and the estimate's error against the peak."""
    trainer = build_trainer(cfg, devices=list(devices) if devices else None, abstract=True)
    device = trainer.mesh.devices.flat[0]
    try:
        with _compile_progress(cfg, trainer):
            compiled, lower_s, compile_s = compile_step(trainer)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The TPU compiler refuses a program whose buffers exceed the chip's memory: that is
        # the verdict, with what it needed.
        return {
            "platform": device.platform,
            "device_kind": device.device_kind,
            "chips": trainer.mesh.size,
            "slices": cfg.mesh.num_slices,
            "fit": {"device": device.device_kind, "fits": False},
            "compiler_refused": str(e).splitlines()[0],
        }
    hlo = compiled.as_text()
    if hlo_path:
        files.write_atomic(hlo_path, hlo)
    found = program.kernels(hlo)
    program.check_kernels(
        trainer.cfg.model, trainer.cfg.compute, found, trainer.mesh.shape["context"]
    )
    analysis = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}  # none for a GPU compiled without one
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731
    peak = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )
    slices = device_slices(trainer.mesh, cfg.mesh.num_slices) if cfg.mesh.num_slices > 1 else None
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "chips": trainer.mesh.size,
        "slices": cfg.mesh.num_slices,
        "lower_s": round(lower_s, 1),
        "compile_s": round(compile_s, 1),
        "gib_per_device": {
            "arguments": gib(analysis.argument_size_in_bytes),
            "outputs": gib(analysis.output_size_in_bytes),
            "aliased": gib(analysis.alias_size_in_bytes),
            "temporaries": gib(analysis.temp_size_in_bytes),
            "peak": gib(peak),
        },
        # the estimate against the compiler's peak: (estimate - peak) / peak
        "estimate_error": round(estimated_gib / (peak / 2**30) - 1, 3) if peak else None,
        "fit": memory.fit(peak / 2**30, device.device_kind),
        "flops_per_device": cost.get("flops"),
        "bytes_accessed_per_device": cost.get("bytes accessed"),
        "collective_bytes": collectives.collective_bytes_per_axis(
            hlo, dict(trainer.mesh.shape), slices
        ),
        "kernels": found,
        "predicted": predicted(cfg, trainer, hlo),
    }


def predicted(cfg: config_lib.Config, trainer, hlo: str) -> dict:
    """The step time the compiled program predicts on its chip (analysis/step_time.py), or
    why there is none: a CPU has no peak FLOP/s or HBM bandwidth in the chip table."""
    kind = trainer.mesh.devices.flat[0].device_kind
    chip = devices_lib.chip(kind)
    if chip is None:
        return {"chip": None, "why": f"no figures for {kind!r} in maxtrain/common/devices.py"}
    where = transfers.placement(list(trainer.mesh.devices.flat), dict(trainer.mesh.shape))
    prediction = step_time.predict(hlo, chip, where)
    return step_time.summary(
        prediction, cfg.tokens_per_step, trainer.mesh.size, trainer.flops_per_token
    )


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps first")
    parser.add_argument("--profile-dir", help="also capture a jax.profiler trace of 2 steps here")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run nothing: print the estimated memory per device (maxtrain/analysis/memory.py)",
    )
    parser.add_argument(
        "--devices", type=positive_int, help="--dry-run: devices in the run (default: this host's)"
    )
    parser.add_argument(
        "--device",
        help="--dry-run: the device kind to fit, e.g. 'TPU v5e', 'H100' (default: this host's)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="--dry-run: also compile the step on this host's devices (nothing allocated) and "
        "print its memory and collective bytes",
    )
    parser.add_argument(
        "--topology",
        help="--dry-run --compile: compile for this TPU topology instead, as libtpu names it "
        "(v5e:2x2, v5e:16x16, v6e:16x16, v5p:4x4x4; mesh.num_slices of them), with the TPU "
        "compiler on this host (./setup.sh tpu-compiler; docs/tpu.md), or for NVIDIA GPUs "
        "(h100, h200, b200, h100:8 for 8 on one host; ./setup.sh gpu-compiler)",
    )
    parser.add_argument(
        "--save-hlo",
        metavar="FILE",
        help="--dry-run --compile: also write the compiled program's text (HLO) to FILE",
    )
    args = parser.parse_args(argv)
    args.config, *args.overrides = path_first([args.config, *args.overrides])
    try:
        cfg = config_lib.load(args.config, args.overrides)
        if args.compile and not args.dry_run:
            raise UserError("--compile goes with --dry-run")
        if (args.topology or args.save_hlo) and not args.compile:
            flag = "--topology" if args.topology else "--save-hlo"
            raise UserError(f"{flag} goes with --dry-run --compile")
        devices = topology_devices(args.topology, cfg.mesh.num_slices) if args.topology else None
        count = len(devices) if devices else jax.device_count()
        if args.compile and args.devices not in (None, count):
            where = (
                f"topology {args.topology} x {cfg.mesh.num_slices} slices"
                if devices
                else ("this host")
            )
            raise UserError(
                f"--dry-run --compile compiles for the {count} devices of {where}, not "
                f"--devices {args.devices}"
                + (
                    ""
                    if devices
                    else f" (simulate them: XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={args.devices})"
                )
            )
        if args.dry_run:
            device = devices[0].device_kind if devices else jax.devices()[0].device_kind
            # --device, else the device the config is written for (run.device), else this host's
            named, what = (
                (args.device, "--device") if args.device else (cfg.run.device, "run.device")
            )
            if named:
                if devices_lib.chip(named) is None and named.lower() != "cpu":
                    known = ", ".join(
                        ["cpu", *(kind for c in devices_lib.CHIPS for kind in c.kinds)]
                    )
                    raise UserError(f"{what} {named!r}: memory not known; known: {known}")
                if devices and args.device and devices_lib.platform(named) != "tpu":
                    raise UserError(f"--device {named!r} is no TPU; --topology is")
                device = device if devices else named
            result = dry_run(
                cfg, args.devices or count, args.compile, device, devices, args.save_hlo
            )
        else:
            result = benchmark(cfg, args.steps, args.warmup, args.profile_dir)
    except UserError as e:
        return refuse("benchmark", e)
    except program.MissingKernel as e:  # maxtrain's failure, not the user's: exit 1
        print(f"benchmark: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0
