"""The memory pre-flight: before a run allocates or writes anything, its memory estimate
(memory.py) against what its devices hold; a run that cannot fit is refused in one line.

A model too big for the machine used to get as far as the checkpointer's first save, then die
with XLA's `RESOURCE_EXHAUSTED` traceback, leaving a locked, empty run directory behind.

What a device holds: on GPU and TPU its allocator's limit (`memory_stats()["bytes_limit"]`),
else the vendor's figure for its kind (the chip table, maxtrain/common/devices.py); on CPU the
host's RAM (physical, or the cgroup's limit where lower), which every CPU device of the
process shares.
The host's total, not what is free at this moment: the same command gets the same answer
whatever else happens to run beside it.

The margin: the estimate is checked against XLA's own buffer assignment to within 30% either
way (tests/analysis/test_memory.py), so a run is refused only when even an estimate 30% too
high would not fit: estimate > MARGIN x memory. A run within the margin starts, and may still
run out. run.check_memory=false skips the check.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from maxtrain.analysis import memory
from maxtrain.common.errors import UserError
from maxtrain.config import Config
from maxtrain.training import run_model

MARGIN = 1.3  # the estimate's error bound against the compiled step (tests/analysis/test_memory.py)
CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")  # cgroup v2: "max" or a byte count


class OutOfMemory(UserError):
    """The run's memory estimate is beyond what its devices hold, margin included."""


def check_memory(cfg: Config) -> None:
    """Refuses (OutOfMemory) a run whose estimate exceeds MARGIN x its devices' memory; does
    nothing with run.check_memory false, or where the devices' memory is not known."""
    if not cfg.run.check_memory:
        return
    device = jax.local_devices()[0]
    capacity = device_memory_bytes(device)
    if capacity is None:
        return
    platform_cfg = run_model.for_platform(
        cfg, device.platform, device.device_kind, jax.device_count() // cfg.mesh.num_slices
    )
    per_device = memory.estimate(platform_cfg, jax.device_count()).total
    sharing = jax.local_device_count() if device.platform == "cpu" else 1
    needed = per_device * sharing
    if needed > MARGIN * capacity:
        raise OutOfMemory(_refusal(needed, capacity, device.platform, sharing))


def device_memory_bytes(device: jax.Device) -> int | None:
    """Bytes one device can allocate: host RAM on CPU (shared by the process's CPU devices),
    the allocator's limit on GPU/TPU, else the vendor's figure for its kind; None if unknown."""
    if device.platform == "cpu":
        return host_memory_bytes()
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    gib = memory.device_memory_gib(device.device_kind)
    return None if gib is None else int(gib * 2**30)


def host_memory_bytes() -> int | None:
    """The host's physical RAM, or its cgroup's memory limit where that is lower (a container
    sees the machine's RAM but may use only its limit); None where neither can be read."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without these names
        physical = None
    try:
        limit = int(CGROUP_LIMIT.read_text().strip())
    except (OSError, ValueError):  # no cgroup v2, or "max": no limit
        limit = None
    known = [b for b in (physical, limit) if b]
    return min(known) if known else None


def _refusal(needed: int, capacity: int, platform: str, sharing: int) -> str:
    """One line: the estimate, the memory it is beyond, and what to do about it."""
    gib = 2**30
    if platform == "cpu":
        shared = f", shared by its {sharing} CPU devices" if sharing > 1 else ""
        what = f"{needed / gib:.1f} GiB, more than {MARGIN}x the host's {capacity / gib:.1f} GiB "
        what += f"of RAM{shared}"
    else:
        what = f"{needed / gib:.1f} GiB per device, more than {MARGIN}x the {capacity / gib:.1f} "
        what += f"GiB a {platform.upper()} device holds"
    return (
        f"this run needs an estimated {what} (python tools/benchmark.py CONFIG "
        "--dry-run shows the parts); use more devices or a smaller model, batch or seq_len, or "
        "set run.check_memory=false to start anyway"
    )
