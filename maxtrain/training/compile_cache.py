"""What maxtrain keeps on disk between runs on one machine: the embedded corpus and compiled
programs, under one root ($MAXTRAIN_CACHE, default ~/.cache/maxtrain).

Compiled programs: every run used to compile its train step from scratch, seconds on a CPU and
minutes for a large model on a TPU slice. JAX's persistent compilation cache stores each
compiled program keyed by the program, the compiler version and flags, and the devices, so a
restart (after a preemption, or to resume) loads the step instead of compiling it again. A
stale entry cannot be used by mistake: any change to the program changes the key.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def root() -> Path:
    return Path(os.environ.get("MAXTRAIN_CACHE") or Path.home() / ".cache" / "maxtrain")


def enable_compilation_cache(directory: str | None) -> Path | None:
    """Turns on JAX's persistent compilation cache in `directory` (run.compilation_cache_dir:
    None = <root>/compilation, "" = off) for every later compilation; returns the directory."""
    if directory == "":
        return None
    path = Path(directory).expanduser() if directory else root() / "compilation"
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program that took a while to compile; the default (1 s) skips small ones that
    # still add up at start-up (the eval step, the state initialisation).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path
