"""What a compile says while it runs: a large model's step compiles for minutes (3 min 12 s for
llama3-8b on v5e:16x16), and a console silent that long looks hung.

`compile_progress` wraps the call that compiles (a jitted function's first call, or an explicit
`.compile()`). After a few seconds, and then every half minute, it says what is compiling, for
which devices, how long it has taken so far and how long the last compile of the same thing took
on this machine; at the end, one line: compiled in how long, or loaded from JAX's persistent
compilation cache (maxtrain/training/compile_cache.py). A call that compiles nothing (the
program is already in memory) says nothing. JAX reports each phase to its monitoring listeners
as it starts and ends (jax.monitoring), in the compiling thread; only that thread's reports
count, so a data thread's small compiles do not mix in.

The last compile times are kept in <cache root>/compile_times.json, keyed by what and where.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator

import jax

from maxtrain.common import files
from maxtrain.training.compile_cache import root

FIRST_LINE_S = 5.0  # a shorter compile gets only its closing line
EVERY_S = 30.0
RECORD = "compile_times.json"

# JAX's monitoring events (jax/_src/dispatch.py, compiler.py).
_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "compiling",
}
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class _Watch:
    """The phase the compiling thread is in, from JAX's monitoring reports."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.phase = "tracing"
        self.compiled = self.cache_hit = False

    def on_start(self, event: str, _value: float, **_) -> None:  # a phase starts
        if threading.get_ident() == self.thread and event in _PHASES:
            self.phase = _PHASES[event]

    def on_duration(self, event: str, _seconds: float, **_) -> None:  # a phase ends
        if threading.get_ident() == self.thread and _PHASES.get(event) == "compiling":
            self.compiled = True

    def on_event(self, event: str, **_) -> None:
        if threading.get_ident() == self.thread and event == _CACHE_HIT:
            self.cache_hit = True


@contextlib.contextmanager
def compile_progress(
    what: str,
    where: str,
    say: Callable[[str], None],
    *,
    first_after: float = FIRST_LINE_S,
    every: float = EVERY_S,
) -> Iterator[None]:
    """Lines about the compile the block runs (module docstring), through `say`: `what` names
    the program ("the train step of llama3-8b"), `where` its devices ("v5e:16x16")."""
    key = f"{what} for {where}"
    last = _last_times().get(key)
    since = "" if last is None else f"; the last compile of it took {duration(last)}"
    watch, done, started = _Watch(), threading.Event(), time.perf_counter()

    def heartbeat() -> None:
        wait = first_after
        while not done.wait(wait):
            so_far = duration(time.perf_counter() - started)
            say(f"maxtrain: {watch.phase} {key}: {so_far} so far{since}")
            wait = every

    listeners = (
        (jax.monitoring.register_scalar_listener, watch.on_start),
        (jax.monitoring.register_event_duration_secs_listener, watch.on_duration),
        (jax.monitoring.register_event_listener, watch.on_event),
    )
    for register, listener in listeners:
        register(listener)
    thread = threading.Thread(target=heartbeat, name="compile-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        jax.monitoring.unregister_scalar_listener(watch.on_start)
        jax.monitoring.unregister_event_duration_listener(watch.on_duration)
        jax.monitoring.unregister_event_listener(watch.on_event)
    took = time.perf_counter() - started
    if watch.cache_hit:
        say(f"maxtrain: {key}: loaded from the compilation cache in {duration(took)}")
    elif watch.compiled:
        say(f"maxtrain: {key}: compiled in {duration(took)}")
        _record(key, took)


def devices_of(mesh: jax.sharding.Mesh) -> str:
    """Where a program compiles for: "256 TPU v5 lite devices", "8 cpu devices"."""
    count, kind = mesh.size, mesh.devices.flat[0].device_kind
    return f"{count} {kind} device{'s' * (count != 1)}"


def duration(seconds: float) -> str:
    """4.2 s, 1 min 5 s."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def _last_times() -> dict[str, float]:
    try:
        times = json.loads((root() / RECORD).read_text())
    except (OSError, ValueError):  # none yet, or unreadable: no figure to give
        return {}
    return times if isinstance(times, dict) else {}


def _record(key: str, seconds: float) -> None:
    """Keeps this compile's time for the next; a cache that cannot be written only loses it."""
    times = {**_last_times(), key: round(seconds, 1)}
    with contextlib.suppress(OSError):
        root().mkdir(parents=True, exist_ok=True)
        files.write_atomic(root() / RECORD, json.dumps(times, indent=1, sort_keys=True) + "\n")
