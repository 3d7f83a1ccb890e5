"""What a compiled program's transfers take on a chip: its collectives over the links their groups
span, its asynchronous copies (to the host's memory over the host link, into the TPU core's
memory at HBM bandwidth), and which instructions start them and wait for them. step_time.py
replays the program's schedule with them.

  collectives  bytes on the wire over the bandwidth of the links a group spans. ICI: both
               neighbours' links of each torus dimension the group spans (a bidirectional ring
               per dimension; the dimensions from the devices' coordinates, or, without them, all
               of a slice's for a group of the whole slice and one for a smaller group); NVLink:
               the GPU's links to its switch; DCN: the chip's share of its host's network, for
               a group across slices or the TPU compiler's transfer to other slices. Per
               device, an all-gather or a reduce-scatter puts (n-1)/n of its buffer on the wire,
               an all-reduce twice that, an all-to-all (n-1)/n of it over n/4 hops of a ring,
               a collective-permute its buffer over one link.
  asynchronous a start (`*-start`, `async-start`, the TPU compiler's `async-collective-start`
               fusion) and a done (`*-done`, the fusion holding `AsyncCollectiveDone`) of one
               transfer: the key they share is the start's name, or the collective's channel.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from maxtrain.analysis import collectives
from maxtrain.analysis.hlo_costs import HOST, VMEM, Array, Instruction, Module
from maxtrain.common.devices import Chip

_ASYNC_DONE = re.compile(r"-done$")


@dataclass(frozen=True)
class Placement:
    """Where the program's devices sit, as its collectives' timing needs to know it.

    coords: each device's physical coordinates, in the program's device order (a TPU device's
        `coords`): a group's torus dimensions are those its members' coordinates differ in.
        Without them a group of every device of a slice spans all of `slice_shape`'s
        dimensions, a smaller group one.
    slices: each device's slice (multi-slice programs: a group across slices uses the DCN).
    slice_shape: one slice's torus, e.g. (16, 16) for v6e:16x16.
    mesh_shape: the mesh axes and sizes over the program's devices, to name a collective by
        the axes it runs over ("fsdp"); without it, by its group size."""

    coords: tuple[tuple[int, ...], ...] | None = None
    slices: tuple[int, ...] | None = None
    slice_shape: tuple[int, ...] = ()
    mesh_shape: dict[str, int] | None = None


class Transfer(NamedTuple):
    """A transfer an instruction starts (or a synchronous collective it runs)."""

    key: str  # what its done names
    link: str  # the link it queues on
    seconds: float
    what: str
    category: str


class Links:
    """The transfers of one program on one chip, placed as `placement` says."""

    def __init__(self, module: Module, chip: Chip, placement: Placement, partitions: int):
        self.module, self.chip, self.placement = module, chip, placement
        self.partitions = partitions
        self.notes: set[str] = set()
        # The TPU compiler's asynchronous collectives, by channel: their start and done may
        # sit outside the loop whose body holds the computation they overlap.
        self.asynchronous = {
            _channel(found[0])
            for body in module.computations.values()
            for ins in body
            if (found := self._fused_collective(ins)) is not None and found[1] != "other"
        }

    def start(self, ins: Instruction) -> Transfer | None:
        """The transfer an instruction starts, if it starts one."""
        if ins.opcode == "copy-start":
            arrays = [a for o in ins.operands for a in self.module.operand_arrays(o)]
            return self._copy(ins, arrays + ins.results[:1])
        if ins.opcode == "send" and collectives.MEGASCALE.search(ins.attributes):
            seconds = sum(a.nbytes for a in ins.results[:1]) / self._dcn()
            return Transfer(ins.name, "dcn", seconds, "send (DCN)", "dcn")
        if ins.opcode.endswith("-start"):
            callee = self.module.callee(ins)
            inner = self.module.computations.get(callee, []) if callee else []
            kind = next((i for i in inner if i.opcode in collectives.COLLECTIVES), None)
            if ins.opcode in collectives.COLLECTIVES or kind is not None:
                target = ins if ins.opcode in collectives.COLLECTIVES else kind
                return self.collective(target)._replace(key=ins.name)
            moved = [a for i in inner for a in self._moved_arrays(i)]
            # an asynchronous slice or update (an offload to the host's memory) is a copy;
            # other asynchronous work is timed as compute, in its place
            return self._copy(ins, moved) if moved else None
        found = self._fused_collective(ins)
        if found is not None and found[1] == "start":
            return self.collective(found[0])._replace(key=_channel(found[0]))
        return None

    def _moved_arrays(self, ins: Instruction) -> list[Array]:
        """What an asynchronous slice or update moves: the slice, where it comes from and
        where it goes (an offloaded activation: between HBM and the host's memory)."""
        if ins.opcode == "dynamic-update-slice":
            update = self.module.operand_arrays(ins.operands[1])
            buffer = self.module.operand_arrays(ins.operands[0])
            return update + [a._replace(space=buffer[0].space) for a in update[:1] if buffer]
        if ins.opcode in ("dynamic-slice", "slice", "copy"):
            source = self.module.operand_arrays(ins.operands[0])
            return ins.results + [a._replace(space=source[0].space) for a in ins.results if source]
        return []

    def _copy(self, ins: Instruction, arrays: list[Array]) -> Transfer:
        """An asynchronous copy: to or from the host's memory over the host link, else (into
        or out of the TPU core's memory) at HBM bandwidth."""
        spaces = {a.space for a in arrays}
        size = max((a.nbytes for a in arrays), default=0)
        if HOST in spaces:
            seconds = size / self.chip.host_bytes_per_s
            return Transfer(ins.name, "host", seconds, ins.opcode, "host transfers")
        seconds = 0.0 if spaces <= {VMEM} else size / self.chip.hbm_bytes_per_s
        return Transfer(ins.name, "dma", seconds, ins.opcode, "copies")

    def done(self, ins: Instruction) -> str | None:
        """The key of the transfer an instruction waits for, if it is a done."""
        if _ASYNC_DONE.search(ins.opcode) and ins.operands:
            return ins.operands[0].partition("#")[0]
        found = self._fused_collective(ins)
        return _channel(found[0]) if found is not None and found[1] == "done" else None

    def _fused_collective(self, ins: Instruction) -> tuple[Instruction, str] | None:
        """The collective inside a fusion, and which part of it this fusion is: the TPU
        compiler's asynchronous "start", "done", or anything else ("other": the computation
        an asynchronous collective overlaps, or a synchronous collective fused with its
        neighbours)."""
        callee = self.module.callee(ins) if ins.opcode == "fusion" else None
        body = self.module.computations.get(callee, []) if callee else []
        collective = next((i for i in body if i.opcode in collectives.COLLECTIVES), None)
        if collective is None:
            return None
        if any("AsyncCollectiveDone" in i.attributes for i in body if i.opcode == "custom-call"):
            return collective, "done"
        if "-start" in ins.name:
            return collective, "start"
        return collective, "other"

    def synchronous(self, ins: Instruction) -> Transfer | None:
        """The collective an instruction runs and waits for, if it does: a collective, or a
        fusion holding one that no asynchronous start opens (the TPU compiler's
        reduce-scatter is an all-reduce fused with the slice each device keeps)."""
        if ins.opcode in collectives.COLLECTIVES:
            return self.collective(ins)
        found = self._fused_collective(ins)
        if found is None or found[1] != "other" or _channel(found[0]) in self.asynchronous:
            return None
        body = self.module.computations[self.module.callee(ins)]
        scatter = found[0].opcode == "all-reduce" and body[-1].opcode == "dynamic-slice"
        return self.collective(found[0], scatter)._replace(key=ins.name)

    def collective(self, ins: Instruction, scatter: bool = False) -> Transfer:
        """A collective instruction's time on its links."""
        kind = "reduce-scatter" if scatter else collectives.COLLECTIVES[ins.opcode]
        result = [a.nbytes for a in ins.results]
        operands = [sum(a.nbytes for a in self.module.operand_arrays(o)) for o in ins.operands]
        moved = collectives.moved_bytes(ins.opcode, result, operands)
        groups = collectives.device_groups(ins.attributes)
        group = groups[0] if groups else list(range(self.partitions))
        n = max(1, len(group))
        crosses = self.placement.slices is not None and collectives.crosses_slices(
            ins.attributes, self.placement.slices
        )
        dims = self._dims(group)
        if crosses:
            bandwidth, network = self._dcn(), "dcn"
        else:
            bandwidth, network = self.chip.ring_bytes_per_s(dims), "collectives"
        wire = _on_the_wire(kind, moved, n, dims if self.chip.torus_dims else 0)
        if kind == "collective-permute" and not crosses:
            bandwidth = self.chip.link_bytes_per_s * (self.chip.ports if not dims else 1)
        axes = self._axes(ins, n)
        category = f"{network} {axes}"  # the link it queues on: its axes' links
        return Transfer(ins.name, category, wire / bandwidth, f"{kind} {axes}", category)

    def _dims(self, group: Sequence[int]) -> int:
        """How many torus dimensions a group of devices spans."""
        coords = self.placement.coords
        if coords is not None and max(group, default=0) < len(coords):
            members = [coords[d] for d in group]
            return sum(1 for axis in zip(*members, strict=True) if len(set(axis)) > 1)
        shape = [d for d in self.placement.slice_shape if d > 1]
        if shape and len(group) >= math.prod(shape):
            return len(shape)
        return 1

    def _axes(self, ins: Instruction, n: int) -> str:
        mesh = self.placement.mesh_shape
        if mesh and math.prod(mesh.values()) == self.partitions:
            return collectives.group_axes(ins.attributes, list(mesh), list(mesh.values()))
        return f"group of {n}"

    def _dcn(self) -> float:
        if self.chip.dcn_bytes_per_s is None:
            self.notes.add(f"{self.chip.name}'s DCN bandwidth is not published: timed as ICI")
            return self.chip.ring_bytes_per_s(1)
        return self.chip.dcn_bytes_per_s


def _channel(collective: Instruction) -> str:
    return f"channel {collectives.channel(collective.attributes)}"


def _on_the_wire(kind: str, moved: int, n: int, torus_dims: int) -> float:
    """Bytes one device sends for a collective of `kind` whose buffer is `moved` bytes, over
    a group of n devices (see the module docstring)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if kind == "all-reduce":
        return 2 * share * moved
    if kind in ("all-to-all", "ragged-all-to-all") and torus_dims:
        per_dim = n ** (1 / torus_dims)
        return share * moved * max(1.0, per_dim / 4)
    if kind == "collective-permute":
        return float(moved)
    return share * moved


def placement(mesh_devices: Sequence, mesh_shape: dict[str, int]) -> Placement:
    """The placement of a program compiled over a mesh's devices (flattened, in mesh order):
    their physical coordinates where they have them (TPU devices), their slices. A program
    over several slices is one slice's (the TPU compiler's multi-slice programs are): its
    devices are the first slice's, its mesh the axes' extent within one slice."""
    slices = [getattr(d, "slice_index", 0) or 0 for d in mesh_devices]
    ours = [d for d, s in zip(mesh_devices, slices, strict=True) if s == slices[0]]
    located = all(hasattr(d, "coords") for d in ours)
    coords = tuple(tuple(d.coords) for d in ours) if located else None
    shape = tuple(max(c[i] for c in coords) + 1 for i in range(len(coords[0]))) if coords else ()
    if len(ours) == len(mesh_devices):
        return Placement(coords, tuple(slices), shape, mesh_shape)
    index = np.unravel_index(np.arange(len(mesh_devices)), list(mesh_shape.values()))
    first = np.asarray(slices) == slices[0]
    per_slice = {name: len(set(index[a][first])) for a, name in enumerate(mesh_shape)}
    return Placement(coords, None, shape, per_slice)
