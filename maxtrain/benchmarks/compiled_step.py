"""What the compiled train step says of itself, for `tools/benchmark.py --dry-run --compile`:
the step compiled from shapes alone (nothing allocated) for this host's devices or a TPU/GPU
topology's, read back per device: XLA's memory, FLOPs, collective bytes (ICI and DCN apart),
the hand-written kernels in it, with pipeline stages the schedule's idle share, and, on a chip of
the table, the step time it predicts."""

from __future__ import annotations

import functools
import sys

import jax

from maxtrain import config as config_lib
from maxtrain.analysis import bubble, collectives, memory, program, step_time, transfers
from maxtrain.common import devices as devices_lib
from maxtrain.common import files
from maxtrain.parallel.mesh import device_slices
from maxtrain.training.compile_progress import compile_progress, devices_of
from maxtrain.training.trainer import build_trainer, compile_step


def compile_progress_on_stderr(cfg: config_lib.Config, trainer):
    """Lines on stderr while the step compiles (minutes on a TPU slice); stdout is the JSON."""
    say = functools.partial(print, file=sys.stderr, flush=True)
    what = f"the train step of {cfg.model_name}"
    return compile_progress(what, devices_of(trainer.mesh), say)


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
    where = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "chips": trainer.mesh.size,
        "slices": cfg.mesh.num_slices,
    }
    try:
        with compile_progress_on_stderr(cfg, trainer):
            compiled, lower_s, compile_s = compile_step(trainer)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The TPU compiler refuses a program whose buffers exceed the chip's memory: that is
        # the verdict, with what it needed.
        return {
            **where,
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
    gib_per_device, peak = _memory_gib(compiled.memory_analysis())
    cost = compiled.cost_analysis() or {}  # none for a GPU compiled without one
    slices = device_slices(trainer.mesh, cfg.mesh.num_slices) if cfg.mesh.num_slices > 1 else None
    return {
        **where,
        "lower_s": round(lower_s, 1),
        "compile_s": round(compile_s, 1),
        "gib_per_device": gib_per_device,
        # the estimate against the compiler's peak: (estimate - peak) / peak
        "estimate_error": round(estimated_gib / (peak / 2**30) - 1, 3) if peak else None,
        "fit": memory.fit(peak / 2**30, device.device_kind),
        "flops_per_device": cost.get("flops"),
        "bytes_accessed_per_device": cost.get("bytes accessed"),
        "copies": program.copy_count(hlo),
        "collective_bytes": collectives.collective_bytes_per_axis(
            hlo, dict(trainer.mesh.shape), slices
        ),
        "kernels": found,
        **pipeline_idle_share(trainer, hlo),
        "predicted": predicted(cfg, trainer, hlo),
    }


def _memory_gib(analysis) -> tuple[dict[str, float], int]:
    """(XLA's memory analysis in GiB per device, rounded; the peak in bytes): the parts add up
    to the peak as arguments and outputs, less what the donated state aliases, plus
    temporaries."""
    gib = lambda n: round(n / 2**30, 3)  # noqa: E731
    peak = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )
    return {
        "arguments": gib(analysis.argument_size_in_bytes),
        "outputs": gib(analysis.output_size_in_bytes),
        "aliased": gib(analysis.alias_size_in_bytes),
        "temporaries": gib(analysis.temp_size_in_bytes),
        "peak": gib(peak),
    }, peak


def pipeline_idle_share(trainer, hlo: str) -> dict:
    """With pipeline stages, the schedule's idle share read from the compiled program
    (analysis/bubble.py) beside the table's formula value, or why it cannot be read; nothing
    without stages."""
    layout = trainer.saved.layout
    if layout is None:
        return {}
    idle = {"schedule": layout.table.schedule, "formula": round(layout.bubble, 4)}
    try:
        reading = bubble.read(hlo, layout.table)
    except ValueError as e:
        return {"pipeline_idle_share": {**idle, "compiled": None, "why": str(e)}}
    return {"pipeline_idle_share": {**idle, "compiled": round(reading.idle_share, 4)}}


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
