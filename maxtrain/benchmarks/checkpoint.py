"""Times checkpoint saves and the restore of a large train state through maxtrain's Checkpointer.

    python tools/benchmark_checkpoint.py [--params 1e9] [--saves 3] [--dir DIR]
        [--no-prewarm] [--persistent-every N] [--no-update] [--trim-after-step]

For each save it reports the tier it went to, how long `maybe_save` blocked the caller (the
train loop's cost: the device-to-host copy plus Orbax's bookkeeping) and how long until the
checkpoint was durable (committed); then the time to restore the newest one (which checks the
content checksums each save records; `checksum_s` is their cost alone). One JSON line per
save, one for the restore, one summary line. Every save goes to the local tier; with
--persistent-every N, every Nth is due in both tiers and goes to the persistent tier alone (one
host copy; `both_due` in its line, `max_blocked_both_due_s` in the summary).

The state is a TrainState whose params are --params float32 numbers in [rows, 8192] matrices
sharded on dim 0 over every device, with two Adam moments of the same shapes: 12 bytes per
parameter (1e9 -> 11.2 GiB). Values are uniform random, so compression cannot shrink them (a
constant state compresses ~2000x and would flatter the write times). Between saves a donating
update changes every value, as a train step would. On CPU the state lives in host memory and
a save's host "copy" is a view, but JAX will not donate a buffer numpy has seen, so the update
after a save needs a second state: 1e9 params then need ~23 GiB (use --no-update on 24 GiB).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxtrain.checkpointing import Checkpointer, abstract_like, checksums
from maxtrain.common.errors import (
    ArgumentParser,
    UserError,
    non_negative_int,
    positive_float,
    positive_int,
    refuse,
)
from maxtrain.config import CheckpointConfig, CheckpointTier
from maxtrain.training.state import TrainState

COLS = 8192
PROG = "benchmark_checkpoint"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--params", type=positive_float, default=1e9, help="float32 parameters")
    p.add_argument("--saves", type=positive_int, default=3)
    p.add_argument(
        "--dir", default=None, help="checkpoint directory (default: a temp dir, removed)"
    )
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false")
    p.add_argument(
        "--persistent-every", type=non_negative_int, default=0, help="also save the persistent tier"
    )
    p.add_argument(
        "--trim-after-step",
        action="store_true",
        help="gc + malloc_trim after each update, before the next save (release_host_memory)",
    )
    p.add_argument(
        "--no-update",
        dest="update",
        action="store_false",
        help="save the same state each time (on CPU the update after a save needs 2x the state)",
    )
    return p.parse_args(argv)


def build_state(num_params: int) -> TrainState:
    """Params [rows, COLS] (rows <= COLS, divisible by the device count) plus mu and nu."""
    devices = jax.devices()
    n = len(devices)
    sharding = NamedSharding(jax.make_mesh((n,), ("fsdp",), devices=devices), P("fsdp", None))
    rows_left = math.ceil(num_params / COLS)
    shapes = []
    while rows_left > 0:
        rows = min(COLS, math.ceil(rows_left / n) * n)
        shapes.append((rows, COLS))
        rows_left -= rows

    def fill(seed: int, shape: tuple[int, int]) -> jax.Array:
        make = jax.jit(lambda k: jax.random.uniform(k, shape, jnp.float32), out_shardings=sharding)
        return make(jax.random.key(seed))

    def tree(offset: int) -> dict[str, jax.Array]:
        return {f"w{i:02d}": fill(offset + i, s) for i, s in enumerate(shapes)}

    replicated = NamedSharding(sharding.mesh, P())
    count = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    adam = optax.ScaleByAdamState(count=count, mu=tree(1000), nu=tree(2000))
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return jax.block_until_ready(TrainState(step=step, params=tree(0), opt_state=(adam,)))


def time_checksums(state: TrainState) -> float:
    """Seconds the content checksums every save computes (checksums.py) take for this state,
    compiled: the device time a save adds, off the loop's critical path on an accelerator."""
    checksums.of(state)  # compiles
    t0 = time.perf_counter()
    checksums.of(state)
    return time.perf_counter() - t0


def release_host_memory() -> None:
    """Returns freed heap memory to the OS now (glibc keeps it in its arenas otherwise).

    On CPU this matters: JAX cannot donate a buffer that was handed to numpy (as Orbax does to
    write it), so the step after a save allocates a new state and frees the old one; glibc
    keeps the freed memory (RSS grows to 3-4x the state) and later returns it in bulk, in kernel
    time, at whatever call happens then, often the next save (~0.1 s per GiB on 2 cores)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def emit(record: dict) -> None:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="maxtrain-ckpt-bench-"))
    try:
        return run(args, root)
    except UserError as e:  # e.g. an unwritable --dir
        return refuse(PROG, e)
    finally:
        if args.dir is None:  # a temp dir: the checkpoints (2 x the state) go with it
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> int:
    cfg = CheckpointConfig(
        local=CheckpointTier(dir=str(root / "local"), every_steps=1, keep=2),
        persistent=CheckpointTier(
            dir=str(root / "persistent"), every_steps=args.persistent_every or 10**9, keep=1
        ),
    )
    state, built = _build_and_describe(args, root)
    checksum_s = time_checksums(state)
    emit({"checksum_s": checksum_s})

    ckpt = Checkpointer(cfg, run_dir=root, prewarm=args.prewarm)
    prewarm_s = ckpt.prewarm(state) if args.prewarm else 0.0
    prewarm_parts = {f"prewarm_{k}": v for k, v in ckpt.prewarm_times.items()}
    state, saves = _save_repeatedly(args, ckpt, state)
    ckpt.close()

    expected = checksums.of(state)
    abstract = abstract_like(state)
    del state, ckpt  # room for the restored copy
    restore_s, exact = _restore_and_compare(cfg, root, abstract, expected)

    blocked = [s["blocked_s"] for s in saves]
    blocked_both_due = [s["blocked_s"] for s in saves if s["both_due"]]
    emit(
        {
            "summary": True,
            "params": built["params"],
            "state_gib": built["state_gib"],
            "device_kind": built["device_kind"],
            "prewarm": args.prewarm,
            "trim_after_step": args.trim_after_step,
            "update_between_saves": args.update,
            "prewarm_s": prewarm_s,
            **prewarm_parts,
            "checksum_s": checksum_s,
            "first_save_blocked_s": blocked[0],
            "max_blocked_s": max(blocked),
            "max_blocked_both_due_s": max(blocked_both_due, default=None),
            "median_durable_s": statistics.median(s["durable_s"] for s in saves),
            "restore_s": restore_s,
            "bit_exact": exact,
        }
    )
    return 0 if exact else 1


def _build_and_describe(args: argparse.Namespace, root: Path) -> tuple[Any, dict]:
    """The synthetic state of --params parameters, and its description (printed)."""
    t0 = time.perf_counter()
    state = build_state(int(args.params))
    device = jax.devices()[0]
    built = {
        "params": sum(x.size for x in jax.tree.leaves(state.params)),
        "state_gib": sum(x.nbytes for x in jax.tree.leaves(state)) / 2**30,
        "devices": jax.device_count(),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "build_s": time.perf_counter() - t0,
        "dir": str(root),
    }
    emit(built)
    return state, built


def _save_repeatedly(
    args: argparse.Namespace, ckpt: Checkpointer, state: Any
) -> tuple[Any, list[dict]]:
    """--saves saves, each timed until it returns (blocked) and until it is durable, with an
    update of every array between them when asked (a train step's worth of new values)."""
    update = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    saves = []
    for step in range(1, args.saves + 1):
        t0 = time.perf_counter()
        tiers = ckpt.maybe_save(step, state)
        blocked = time.perf_counter() - t0
        ckpt.wait_until_finished()
        durable = time.perf_counter() - t0
        release_host_memory()
        both = bool(args.persistent_every) and step % args.persistent_every == 0
        saves.append(
            {
                "save": step,
                "tiers": tiers,
                "both_due": both,
                "blocked_s": blocked,
                "durable_s": durable,
            }
        )
        emit({**saves[-1], "rss_gib": rss_gib()})
        if step < args.saves and args.update:
            state = jax.block_until_ready(update(state))  # the next "train step"
            if args.trim_after_step:
                release_host_memory()
    return state, saves


def _restore_and_compare(
    cfg: CheckpointConfig, root: Path, abstract: Any, expected: Any
) -> tuple[float, bool]:
    """(seconds to restore the newest save, whether it is bit-exact), printed."""
    release_host_memory()
    t0 = time.perf_counter()
    with Checkpointer(cfg, run_dir=root) as fresh:
        restored, step = fresh.restore_latest(abstract)
        jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    exact = expected == checksums.of(restored)
    emit({"restore_step": step, "restore_s": restore_s, "bit_exact": exact, "rss_gib": rss_gib()})
    return restore_s, exact
