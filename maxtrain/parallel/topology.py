"""Compile-only TPU devices: the TPU compiler (libtpu) run on a host with no TPU.

`topology_devices("v5e:4x4")` returns the 16 devices of a v5e 4x4 slice as the TPU compiler
sees them. They build a mesh like real devices do (mesh.build_mesh), and a jitted step lowered
over that mesh with abstract arguments compiles into the program a real slice would run, with
the compiler's own memory and cost figures. Nothing can execute on them. This is how a run is
checked before a slice is paid for (`tools/benchmark.py ... --dry-run --compile
--topology`).

Where libtpu comes from, first found wins:
  1. `TPU_LIBRARY_PATH`, a libtpu.so of the user's;
  2. the `libtpu` package (`pip install -e '.[tpu]'`, what TPU VMs run);
  3. `<venv>/tpu-compiler/libtpu/libtpu.so`, which `./setup.sh tpu-compiler` installs from the
     `tpu-compiler` extra of pyproject.toml. It is kept out of site-packages on purpose: with
     libtpu importable, every jax process on a host without a TPU tries to start a TPU
     runtime and prints a dozen lines about missing TPU environment variables; kept apart,
     only a process that asks for a topology loads it.

libtpu reads a few environment variables when it loads. On a host with no TPU they are
missing, and it says so on stderr; they are set here (when unset) to values that describe the
topology asked for, so that the first load is quiet. They do not decide what is compiled for:
the topology does.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import jax

from maxtrain.common.errors import UserError

# libtpu's name for a TPU generation -> the accelerator-type prefix of a Cloud TPU of that
# generation (TPU_ACCELERATOR_TYPE, as a TPU VM sets it: "v5litepod-16", "v6e-16", "v5p-32").
_ACCELERATOR_PREFIX = {"v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}
_NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")
_LIBTPU = Path("tpu-compiler") / "libtpu" / "libtpu.so"


def parse_topology(name: str) -> tuple[str, int]:
    """(generation, chips) of a topology name as libtpu spells it: "v5e:2x2", "v6e:16x16",
    "v5p:4x4x4". Raises UserError naming the forms it takes."""
    match = _NAME.match(name)
    if match is None:
        known = ", ".join(_ACCELERATOR_PREFIX)
        raise UserError(
            f"--topology {name!r}: expected GENERATION:AxB (or AxBxC for v4/v5p), "
            f"e.g. v5e:2x2, v6e:16x16, v5p:4x4x4; generations: {known}"
        )
    generation, *dims = match.groups()
    chips = 1
    for d in dims:
        chips *= int(d or 1)
    return generation, chips


def libtpu_path() -> str | None:
    """The libtpu.so to compile with (see the module docstring), or None if none is installed."""
    from jax._src import cloud_tpu_init

    if found := cloud_tpu_init.get_tpu_library_path():
        return found
    beside = Path(sys.prefix) / _LIBTPU
    return str(beside) if beside.is_file() else None


@functools.cache
def topology_devices(name: str, num_slices: int = 1) -> tuple[jax.Device, ...]:
    """The compile-only devices of `num_slices` slices of topology `name` (all slices' devices,
    slice by slice; those of several slices carry their slice_index). Cached: libtpu builds a
    topology once per process."""
    generation, chips = parse_topology(name)
    path = libtpu_path()
    if path is None:
        raise UserError(
            f"--topology {name}: the TPU compiler (libtpu) is not installed; run "
            "'./setup.sh tpu-compiler' (or pip install -e '.[tpu]' on a TPU VM)"
        )
    os.environ.setdefault("TPU_LIBRARY_PATH", path)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{_ACCELERATOR_PREFIX[generation]}-{chips}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask
    # Several processes (test workers, a tool beside a run) may load libtpu at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            topology_name=name, platform="tpu", num_slices=num_slices
        )
    except Exception as e:  # libtpu's message names what it did not accept
        raise UserError(f"--topology {name} (slices {num_slices}): libtpu refused it: {e}") from e
    return tuple(topology.devices)
