"""The collectives of a compiled program: the bytes each kind moves per device and step, by
the mesh axes it runs over, ICI and DCN apart (`tools/benchmark.py` prints them), and what the
step-time model (step_time.py) needs of one collective: its kind, its bytes, its groups."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator, Sequence

import numpy as np

from maxtrain.analysis.program import executed, operand_names, shape_bytes

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
MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


def collective_bytes(hlo_text: str, device_slices: Sequence[int] | None = None) -> dict[str, int]:
    """Bytes per collective kind that one execution of a compiled program moves, per device.

    Each collective counts its whole buffer as the program declares it (the larger of its
    operands and its result: an all-gather's output, a reduce-scatter's input), times how often
    it runs: a collective inside a loop (a scan over layers) counts once per iteration, by the
    trip count XLA records. A loop whose trip count only the run decides (the expert-parallel
    exchange's overflow rounds, parallel/expert_exchanges.py) is apart: its collectives count once
    per trip under "<kind> per loop trip", not in the kind's total. Read from
    `jax.jit(f).lower(...).compile().as_text()`, so it sees the collectives the SPMD
    partitioner inserted as well as those written by hand.

    device_slices: the slice of each device of the program, in its device order (the mesh's
    devices, flattened). Then a collective whose groups (or, for a collective-permute, whose
    source-target pairs) join devices of different slices also counts under "dcn <kind>": the
    traffic that crosses the data-center network.
    """
    totals: dict[str, int] = collections.Counter()
    for kind, moved, attributes in _collectives(hlo_text):
        if MEGASCALE.search(attributes):  # a TPU program's transfer to other slices: DCN only
            totals[f"dcn {kind}"] += moved
            continue
        totals[kind] += moved
        if device_slices is not None and crosses_slices(attributes, device_slices):
            totals[f"dcn {kind}"] += moved
    return dict(totals)


def collective_bytes_per_axis(
    hlo_text: str, mesh_shape: dict[str, int], device_slices: Sequence[int] | None = None
) -> dict[str, dict[str, int]]:
    """`collective_bytes` by the mesh axes each collective runs over, ICI and DCN apart:
    {"ici": {"all-gather fsdp": bytes, "all-reduce data+fsdp": ...}, "dcn": {...}}.

    The axes of a collective are those along which the devices of one of its groups differ
    (device i of the program is the mesh's i-th device, flattened: its mesh coordinates are
    i unravelled over mesh_shape, in the mesh's axis order). A collective joining devices of
    several slices (device_slices) counts under "dcn", the rest under "ici".

    The TPU compiler builds a multi-slice program per slice: its collectives join the devices
    of one slice (device i is then the slice's i-th, over the slice's own shape), and what
    crosses slices is a transfer to the DCN runtime (a `send` marked for "megascale"), counted
    under "dcn" over the axes that span slices."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = np.array(np.unravel_index(np.arange(int(np.prod(sizes))), sizes))  # [axes, devices]
    slices = np.asarray(device_slices) if device_slices else np.zeros(coords.shape[1], int)
    dcn_axes = [n for a, n in enumerate(names) if _varies_with(coords[a], slices)]
    partitions = re.search(r"\bnum_partitions=(\d+)", hlo_text)
    if partitions and int(partitions[1]) < coords.shape[1]:  # one slice's program
        sizes = [len(set(coords[a][slices == 0])) for a in range(len(names))]
    totals: dict[str, dict[str, int]] = {"ici": collections.Counter(), "dcn": collections.Counter()}
    for kind, moved, attributes in _collectives(hlo_text):
        if MEGASCALE.search(attributes):
            totals["dcn"][f"{kind} {'+'.join(dcn_axes)}"] += moved
            continue
        axes = group_axes(attributes, names, sizes)
        network = "dcn" if device_slices and crosses_slices(attributes, device_slices) else "ici"
        totals[network][f"{kind} {axes}"] += moved
    return {network: dict(counts) for network, counts in totals.items()}


def group_axes(attributes: str, names: Sequence[str], sizes: Sequence[int]) -> str:
    """The mesh axes a collective runs over ("fsdp", "data+fsdp"): those along which the
    devices of one of its groups differ, device i being the mesh's i-th (its coordinates i
    unravelled over the axes' sizes)."""
    groups = device_groups(attributes) or [list(range(int(np.prod(sizes))))]
    members = [np.array(np.unravel_index(group, sizes)) for group in groups]
    varying = {names[a] for m in members for a in range(len(names)) if len(set(m[a])) > 1}
    return "+".join(n for n in names if n in varying) or "none"


def _varies_with(axis_coords: np.ndarray, slices: np.ndarray) -> bool:
    """Whether devices of different slices differ along this axis (a DCN-spanning axis)."""
    return any(len(set(axis_coords[slices == s])) < len(set(axis_coords)) for s in set(slices))


_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def moved_bytes(opcode: str, result_bytes: list[int], operand_bytes: list[int]) -> int:
    """The buffer a collective moves per device, as the program declares it: the larger of its
    operands and its result (an all-gather's output, a reduce-scatter's input); of an async
    start's or a ragged all-to-all's buffers (inputs, outputs, offsets), the largest."""
    if opcode.endswith("-start") or opcode == "ragged-all-to-all":
        return max([*result_bytes, *operand_bytes])
    return max(sum(result_bytes), sum(operand_bytes))


def channel(attributes: str) -> str | None:
    """A collective's channel: the TPU compiler's start, overlapped part and done of one
    asynchronous collective share it."""
    found = _CHANNEL.search(attributes)
    return found[1] if found else None


def _collectives(hlo_text: str) -> Iterator[tuple[str, int, str]]:
    """(kind, bytes moved per device and step, HLO attributes) of every collective a compiled
    program runs, a loop's counted once per trip (see `collective_bytes`).

    The TPU compiler writes an asynchronous collective as three fusions (its start, the
    computation it overlaps, its done), each holding a copy of the collective with the same
    channel: it counts once."""
    shapes: dict[str, list[int]] = {}
    channels: set[str] = set()
    for op in executed(hlo_text):
        shapes[op.name] = shape_bytes(op.shape)
        suffix = " per loop trip" if op.unknown_loop else ""
        kind = COLLECTIVES.get(op.opcode)
        if kind is not None and (found := channel(op.rest)):
            if found in channels:
                continue
            channels.add(found)
        if kind is not None:
            operand_bytes = [sum(shapes.get(o, [0])) for o in operand_names(op.rest)]
            moved = moved_bytes(op.opcode, shapes[op.name], operand_bytes)
            yield kind + suffix, op.times * moved, op.rest
        elif op.opcode == "send" and (transfer := MEGASCALE.search(op.rest)):
            kind = transfer[1].lower().replace("_", "-")
            yield kind + suffix, op.times * shapes[op.name][0], op.rest


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


def crosses_slices(attributes: str, device_slices: Sequence[int]) -> bool:
    groups = device_groups(attributes)
    if groups is None:
        return len(set(device_slices)) > 1
    return any(len({device_slices[d] for d in group}) > 1 for group in groups)
