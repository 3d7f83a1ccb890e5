"""What a traced or compiled training step really does: the operand dtypes of its matmuls, the
bytes its collectives move, the copies it makes of its inputs.

`tools/benchmark.py` prints it beside the step time, and the quantization tests assert it, so a
quantization rule that silently matches nothing shows up as float matmuls.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# Primitives that do a matmul's work (ragged_dot lowers to ragged_dot_general).
_MATMULS = frozenset({"dot_general", "ragged_dot_general", "ragged_dot"})


def matmul_dtypes(fn: Callable[..., Any], *args: Any) -> collections.Counter:
    """How often each (primitive, operand dtypes) matmul occurs in fn's traced program,
    nested programs (scan, remat, shard_map, custom_vjp) included: what actually multiplies.

    A Pallas kernel (tokamax's attention and grouped matmul on GPU/TPU) counts as one entry,
    `pallas_call <kernel name>`, with the dtypes of its first two matrix operands: what the
    kernel is handed, e.g. int8 weights for the quantized grouped matmul. Its body is not
    searched, since how a kernel multiplies inside is its own business (H100's quantized
    grouped matmul scales its int8 weights to bf16 in registers).
    """
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr: jax.extend.core.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _MATMULS:
                dtypes = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
                counts[(eqn.primitive.name, dtypes)] += 1
            elif eqn.primitive.name == "pallas_call":
                matrices = [v for v in eqn.invars if getattr(v.aval, "ndim", 0) >= 2]
                dtypes = tuple(str(v.aval.dtype) for v in matrices[:2])
                counts[(f"pallas_call {eqn.params.get('name')}", dtypes)] += 1
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


# ---- collectives of a compiled program --------------------------------------------------------

COLLECTIVES = {
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "ragged-all-to-all",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
_DTYPE_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_DTYPE_BYTES |= {"f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_CALLEE = re.compile(r"\b(?:body|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _shape_bytes(text: str) -> list[int]:
    """Bytes of each array in an HLO shape (an array or a tuple of them)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            sizes.append(count * _DTYPE_BYTES[dtype])
    return sizes


def collective_bytes(hlo_text: str, device_slices: Sequence[int] | None = None) -> dict[str, int]:
    """Bytes per collective kind that one execution of a compiled program moves, per device.

    Each collective counts its whole buffer as the program declares it (the larger of its
    operands and its result: an all-gather's output, a reduce-scatter's input), times how often
    it runs: a collective inside a loop (a scan over layers) counts once per iteration, by the
    trip count XLA records. A loop whose trip count only the run decides (the expert-parallel
    exchange's overflow rounds, layers/expert_parallel.py) is apart: its collectives count once
    per trip under "<kind> per loop trip", not in the kind's total. Read from
    `jax.jit(f).lower(...).compile().as_text()`, so it sees the collectives the SPMD
    partitioner inserted as well as those written by hand.

    device_slices: the slice of each device of the program, in its device order (the mesh's
    devices, flattened). Then a collective whose groups (or, for a collective-permute, whose
    source-target pairs) join devices of different slices also counts under "dcn <kind>": the
    traffic that crosses the data-center network.
    """
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.strip() and line.strip() != "}":
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    totals: dict[str, int] = collections.Counter()

    def visit(name: str, times: int, suffix: str = "") -> None:
        shapes: dict[str, list[int]] = {}
        for line in computations.get(name, []):
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            result, shape, opcode, rest = match.groups()
            shapes[result] = _shape_bytes(shape)
            kind = COLLECTIVES.get(opcode)
            if kind is not None:
                operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
                operand_bytes = [sum(shapes.get(o, [0])) for o in operands]
                if opcode.endswith("-start") or opcode == "ragged-all-to-all":
                    moved = max([*shapes[result], *operand_bytes])  # input and output buffers
                else:
                    moved = max(sum(shapes[result]), sum(operand_bytes))
                totals[kind + suffix] += times * moved
                if device_slices is not None and _crosses_slices(rest, device_slices):
                    totals[f"dcn {kind}{suffix}"] += times * moved
            trips = _TRIP_COUNT.search(rest) if opcode == "while" else None
            repeat = int(trips.group(1)) if trips else 1
            inner = " per loop trip" if opcode == "while" and trips is None else suffix
            callees = _CALLEE.findall(rest)
            for branches in _BRANCHES.findall(rest):
                callees += re.findall(r"%([\w.\-]+)", branches)
            for callee in callees:
                visit(callee, times * repeat, inner)

    visit(entry, 1)
    return dict(totals)


_GROUPS = re.compile(r"\b(?:replica_groups|source_target_pairs)=(\{\{[\d,{}\s]*\}\}|\{\})")
_IOTA_GROUPS = re.compile(r"\breplica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"\breplica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def device_groups(attributes: str) -> list[list[int]] | None:
    """The device groups of a collective's HLO attributes, in the forms XLA writes: listed
    (`{{0,1},{2,3}}`), iota (`[groups,size]<=[dims]T(perm)`), over named mesh axes
    (`mesh['a'=2,'b'=4] {'b'}`: the devices that differ only along b), or a collective-permute's
    source-target pairs. None when the instruction names none (all devices are one group)."""
    if match := _IOTA_GROUPS.search(attributes):
        shape, dims, perm = (
            [int(x) for x in group.split(",")] if group else None for group in match.groups()
        )
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        return ids.transpose(perm).reshape(shape).tolist() if perm else ids.reshape(shape).tolist()
    if match := _MESH_GROUPS.search(attributes):
        axes = re.findall(r"'([^']+)'=(\d+)", match[1])
        names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
        over = [names.index(name) for name in re.findall(r"'([^']+)'", match[2])]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        kept = [i for i in range(len(sizes)) if i not in over]
        width = int(np.prod([sizes[i] for i in over]))
        return ids.transpose(kept + over).reshape(-1, width).tolist()
    if match := _GROUPS.search(attributes):
        groups = re.findall(r"\{([\d,\s]*)\}", match[1])
        listed = [[int(x) for x in group.split(",") if x.strip()] for group in groups]
        return listed if any(listed) else None  # `{}`: all devices, one group
    if "replica_groups=" in attributes or "source_target_pairs=" in attributes:
        raise ValueError(f"unrecognised device groups in: {attributes[:200]}")
    return None


def _crosses_slices(attributes: str, device_slices: Sequence[int]) -> bool:
    groups = device_groups(attributes)
    if groups is None:
        return len(set(device_slices)) > 1
    return any(len({device_slices[d] for d in group}) > 1 for group in groups)


# ---- copies of a compiled program's inputs ----------------------------------------------------


def entry_parameter_copies(hlo_text: str) -> list[tuple[str, int]]:
    """The copies a compiled program makes of its own inputs, as (name, bytes): instructions of
    the ENTRY computation that copy one of its parameters. A train step's inputs are the state
    it donates, so a copy of one is a pass over memory the math did not ask for (XLA inserts
    them when an input must outlive the output written into its buffer)."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    parameters: set[str] = set()
    copies = []
    for line in entry.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        result, shape, opcode, rest = match.groups()
        if opcode == "parameter":
            parameters.add(result)
        elif opcode == "copy" and re.match(r"\s*%([\w.\-]+)", rest)[1] in parameters:
            copies.append((result, sum(_shape_bytes(shape))))
    return copies
