"""Compile-only TPU and GPU devices: the TPU compiler (libtpu), or XLA's CUDA compiler, run on
a host with no TPU or GPU.

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

A GPU topology, `h100`, `h200` or `b200`, optionally `:N` GPUs of one host joined by NVLink
(`h100:8`), compiles for NVIDIA GPUs with jax's CUDA plugin given a target description (the
GPU's compute capability, SMs, clock, memories: `_GPU_TARGETS`, its HBM from the chip table),
as XLA's deviceless compilation takes it. The plugin comes from, first found wins:
  1. an importable `jax_plugins.xla_cuda13` (a GPU machine's `jax[cuda13]`);
  2. `MAXTRAIN_GPU_COMPILER`, a directory the plugin's wheels are installed into;
  3. `<venv>/gpu-compiler`, which `./setup.sh gpu-compiler` installs from the `gpu-compiler`
     extra of pyproject.toml, apart from site-packages for the same reason as libtpu: a
     process that finds the plugin importable would look for a GPU on every start.
It loads only when a GPU topology is asked for. No GPU autotuning runs: the program holds
XLA's default choices (kernel tiles) where a GPU would pick the fastest it measures.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from pathlib import Path

import jax

from maxtrain.common import devices as devices_lib
from maxtrain.common.errors import UserError

# libtpu's name for a TPU generation -> the accelerator-type prefix of a Cloud TPU of that
# generation (TPU_ACCELERATOR_TYPE, as a TPU VM sets it: "v5litepod-16", "v6e-16", "v5p-32").
_ACCELERATOR_PREFIX = {"v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}
_NAME = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")
_LIBTPU = Path("tpu-compiler") / "libtpu" / "libtpu.so"


_GPU_NAME = re.compile(r"^(h100|h200|b200)(?::(\d+))?$")
_GPU_PLUGIN = "jax_plugins.xla_cuda13"
# What XLA's GPU compiler reads of a GPU it does not see (NVIDIA's datasheets and CUDA's
# device properties): compute capability, SMs, boost clock (GHz), L2 (MiB), device_kind.
_GPU_TARGETS = {
    "h100": ((9, 0), 132, 1.98, 50, "NVIDIA H100 80GB HBM3"),
    "h200": ((9, 0), 132, 1.98, 50, "NVIDIA H200"),
    "b200": ((10, 0), 148, 1.965, 126, "NVIDIA B200"),
}


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
    if _GPU_NAME.match(name):
        return _gpu_devices(name, num_slices)
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


def _gpu_devices(name: str, num_slices: int) -> tuple[jax.Device, ...]:
    """Compile-only GPUs: `num_slices` hosts of N GPUs (see the module docstring)."""
    gpu, count = _GPU_NAME.match(name).groups()
    count = int(count or 1)
    if not 1 <= count <= 8:
        raise UserError(f"--topology {name}: 1 to 8 GPUs a host, e.g. {gpu}:8")
    _load_gpu_plugin(name)
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=_gpu_target(gpu), topology=f"1x{num_slices}x{count}"
        )
    except Exception as e:  # the plugin's message names what it did not accept
        raise UserError(f"--topology {name}: the CUDA plugin refused it: {e}") from e
    return tuple(topology.devices)


def _load_gpu_plugin(name: str) -> None:
    """Registers jax's CUDA plugin (compile-only), from where the module docstring says, after
    this process's own backends (CPU): registered then, it never starts a GPU runtime."""
    from jax._src import xla_bridge

    jax.devices()
    if "cuda" in xla_bridge._backend_factories:  # a GPU machine's plugin, already registered
        return
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU, no CUDA runtime
    try:
        plugin = importlib.import_module(_GPU_PLUGIN)
    except ImportError:
        places = [os.environ.get("MAXTRAIN_GPU_COMPILER"), str(Path(sys.prefix) / "gpu-compiler")]
        found = next((p for p in places if p and (Path(p) / "jax_plugins").is_dir()), None)
        if found is None:
            raise UserError(
                f"--topology {name}: the GPU compiler (jax's CUDA plugin) is not installed; "
                "run './setup.sh gpu-compiler' (or set MAXTRAIN_GPU_COMPILER to where it is)"
            ) from None
        sys.path.append(found)
        plugin = importlib.import_module(_GPU_PLUGIN)
    plugin.initialize()


def _gpu_target(gpu: str) -> str:
    """The target description (XLA's GpuTargetConfigProto, as text) of one GPU."""
    (major, minor), sms, clock, l2_mib, kind = _GPU_TARGETS[gpu]
    chip = devices_lib.chip(kind)
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {sms}
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {int(chip.hbm_bytes_per_s)}
  l2_cache_size: {l2_mib * 2**20} clock_rate_ghz: {clock}
  device_memory_size: {int(chip.hbm_gib * 2**30)} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{kind}"
"""
