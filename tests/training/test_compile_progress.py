"""What a compile says while it runs (maxtrain/training/compile_progress.py): what compiles for
which devices and for how long so far, the last compile's time once there was one, and a last
line that tells a compile from a program loaded from the compilation cache or already in
memory."""

import time

import jax
import jax.numpy as jnp

from maxtrain.training import compile_progress as progress_lib
from maxtrain.training.compile_progress import compile_progress


def _compile(lines: list[str], fn, *args) -> None:
    """fn's first call under compile_progress, its progress line due at once."""
    with compile_progress("the test program", "1 cpu device", lines.append, first_after=0):
        jax.block_until_ready(fn(*args))


def test_a_compile_says_what_and_where_then_the_last_compile_time(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path))  # no earlier compile times
    first, second, again = [], [], []
    _compile(first, jax.jit(lambda x: jnp.sin(x) * 3), jnp.ones(7))
    assert first[0].startswith("maxtrain: ") and " the test program for 1 cpu device: " in first[0]
    assert first[0].endswith(" s so far"), first  # no earlier compile of it
    assert first[-1].startswith("maxtrain: the test program for 1 cpu device: compiled in ")
    recorded = progress_lib._last_times()["the test program for 1 cpu device"]

    # Another program under the same name: the progress line gives the last one's time.
    twice = jax.jit(lambda x: jnp.cos(x) * 2)
    _compile(second, twice, jnp.ones(5))
    assert second[0].endswith(f"; the last compile of it took {progress_lib.duration(recorded)}")
    # Already compiled in this process: nothing compiles, so a progress line at most.
    _compile(again, twice, jnp.ones(5))
    assert not [line for line in again if "compiled in" in line or "cache" in line], again


def test_a_program_from_the_compilation_cache_says_so(tmp_path, monkeypatch):
    """A persistent-cache hit (every program cached: min compile time 0) is no compile. The
    program holds this session's time, so that no earlier session cached it."""
    monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path))  # its compile time goes there
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    session = float(time.time_ns() % 10**9)
    try:
        for times in range(2):
            jax.clear_caches()  # the in-memory copy: the second call reads the cache on disk
            lines = []
            _compile(lines, jax.jit(lambda x: jnp.tanh(x) - session), jnp.ones(11))
            said = "compiled in " if times == 0 else "loaded from the compilation cache in "
            assert said in lines[-1], lines
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def test_durations_read_as_minutes_past_one():
    assert progress_lib.duration(4.24) == "4.2 s"
    assert progress_lib.duration(192.4) == "3 min 12 s"
