"""Where a profiled step's GPU time goes: kernel time per step, grouped by what the kernels do.

    python tools/benchmark.py CONFIG --profile-dir DIR      # 2 steps under the profiler
    python tools/profile_kernels.py DIR --steps 2

DIR is a jax.profiler trace (its *.xplane.pb files), read with xprof's kernel_stats tool
(`pip install xprof==2.24.2`); or --kernel-stats FILE, that tool's JSON output saved earlier.
Kernels are grouped by name: tokamax's grouped matmul (its weight-gradient kernel apart), the
attention kernels, gathers and scatters, dense matmuls (cuBLAS), transposes, sorts, and the
rest (XLA's element-wise and reduction fusions). recipes/h100/README.md quotes its output.
A missing trace or an unreadable file is one line and exit status 2.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from maxtrain.common.errors import ArgumentParser, UserError, refuse

PROG = "profile_kernels"

# (group, substrings of the kernel's name), the first match wins.
GROUPS = (
    ("grouped matmul, expert weight gradients", ("ragged_contracting",)),
    ("grouped matmul, forward and input gradients", ("ragged_dot",)),
    ("attention kernels", ("flash_attention", "batched_body")),
    ("gathers and scatters", ("gather", "scatter")),
    ("dense matmuls", ("nvjet", "gemm", "cublas", "cutlass")),
    ("transposes", ("transpose",)),
    ("sorts", ("sort", "radix")),
)
OTHER = "element-wise and reductions"


def group(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), OTHER)


def kernel_times(table: dict) -> list[tuple[str, float]]:
    """(kernel name, total microseconds) per row of xprof's kernel_stats table."""
    columns = [c["id"] for c in table["cols"]]
    name, total = columns.index("kernel_name"), columns.index("total_duration_us")
    return [(row["c"][name]["v"], float(row["c"][total]["v"])) for row in table["rows"]]


def per_step(times: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step of each group, largest first."""
    groups: collections.Counter = collections.Counter()
    for name, us in times:
        groups[group(name)] += us / 1000 / steps
    return dict(groups.most_common())


def read_kernel_stats(trace_dir: Path | None, saved: Path | None) -> dict:
    """The kernel_stats table: from a saved JSON, or converted from the trace by xprof."""
    try:
        if saved is not None:
            data = json.loads(saved.read_text())
        else:
            paths = sorted(str(p) for p in trace_dir.rglob("*.xplane.pb"))
            if not paths:
                raise UserError(f"{trace_dir} holds no *.xplane.pb trace (tools/benchmark.py "
                                "--profile-dir writes one)")  # fmt: skip
            try:
                from xprof.convert import raw_to_tool_data
            except ImportError:
                raise UserError("xprof is not installed: pip install xprof==2.24.2") from None
            data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "kernel_stats", {})
            data = json.loads(data)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the kernel statistics: {e}") from None
    table = data[0] if isinstance(data, list) else data
    if not isinstance(table, dict) or "rows" not in table:
        raise UserError("not a kernel_stats table: expected xprof's JSON with cols and rows")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", nargs="?", type=Path, help="tools/benchmark.py --profile-dir")
    parser.add_argument("--kernel-stats", type=Path, help="xprof's kernel_stats JSON instead")
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    args = parser.parse_args(argv)
    try:
        if (args.trace_dir is None) == (args.kernel_stats is None):
            raise UserError("name a trace directory or --kernel-stats FILE (one of them)")
        groups = per_step(kernel_times(read_kernel_stats(args.trace_dir, args.kernel_stats)),
                          args.steps)  # fmt: skip
    except UserError as e:
        return refuse(PROG, e)
    for name, ms in groups.items():
        print(f"{ms:8.1f} ms/step  {name}")
    print(f"{sum(groups.values()):8.1f} ms/step  all kernels")
    return 0
