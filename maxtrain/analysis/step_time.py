"""How long one execution of a compiled program takes on a chip, predicted from the program
alone: `predict(hlo_text, chip, placement)`.

The model replays the program's own schedule (its instructions in the order the compiler
scheduled them; a compiled program's text is that order):
  compute     each instruction takes the longer of its matmul FLOPs at the chip's peak for
              their operand dtype and its HBM bytes at the chip's HBM bandwidth
              (hlo_costs.py), one after another; a fusion is one instruction; a loop's body
              counts once per trip (the trip count the program states), a conditional as
              its most expensive branch;
  transfers   a collective takes its bytes on the wire over the bandwidth of the links its
              group spans (ICI: both neighbours' links of each torus dimension the group
              spans, a ring per dimension; NVLink: the GPU's links to the switch; DCN: the
              chip's share of its host's network where the group crosses slices); per
              device, an all-gather or reduce-scatter puts (n-1)/n of its buffer on the wire,
              an all-reduce twice that, an all-to-all (n-1)/n of it over n/4 hops of a ring,
              a collective-permute its buffer over one link. A copy to or from the host's
              memory (offloaded activations) takes its bytes over the host link, a copy into
              the TPU core's own memory its bytes at HBM bandwidth;
  overlap     a transfer the program makes asynchronous (a start and a done, or the TPU
              compiler's start/continuation/done fusions of one channel) runs on its link
              from its start, beside the compute scheduled before its done, and its done
              waits for it: only what is left then counts. Transfers on one link queue one
              after another. A synchronous collective counts whole.
A loop is replayed twice in a row so that transfers its schedule carries from one trip into
the next overlap as they do in steady state; its time is the first trip plus the trip count
less one times the second.

What it leaves out, so that its figure is a lower bound for the compute and memory parts:
the matrix units' efficiency below peak (tile shapes narrower than the unit, pipeline
fill); element-wise work's own compute (a fusion is timed by its bytes); the contention of
transfers and compute for HBM bandwidth; kernel launch and synchronisation gaps; host-side
work (input pipeline, logging). Kernels' HBM traffic is their operands and results once
(a flash kernel re-reads keys and values per query block). Where a program's loop has a
trip count only the run decides (the expert-parallel exchange's extra rounds), one trip is
counted (`notes` says so).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from maxtrain.analysis import collectives, hlo_costs
from maxtrain.analysis.hlo_costs import HOST, VMEM, Instruction, Module
from maxtrain.analysis.program import callees, trip_count
from maxtrain.common.devices import Chip

_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
    "recv", "recv-done", "send-done",
})  # fmt: skip
_FREE_CALLS = re.compile(r'custom_call_target="(AllocateBuffer|ConcatBitcast)"')  # no traffic
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


@dataclass(frozen=True)
class Cost:
    """One instruction's share of the predicted step."""

    instruction: str
    what: str  # its opcode (and kernel), or the collective and its axes
    category: str
    seconds: float  # per step: once per trip of the loops around it


@dataclass
class StepTimePrediction:
    """The predicted time of one execution of the program on one chip, per device."""

    chip: str
    peak_bf16_flops: float  # the chip's, for MFU
    seconds: float
    bound: str  # the category that takes the most time
    breakdown: dict[str, float]  # seconds per category, adding up to `seconds`
    top: list[Cost]  # the most expensive instructions, most first
    flops: float  # matmul FLOPs per device
    hbm_bytes: float
    unknown_kernels: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def predict(
    program: str | object,
    chip: Chip,
    placement: Placement | None = None,
    top: int = 5,
) -> StepTimePrediction:
    """The step time of a compiled program (its text, or a jax `Compiled`) on `chip`."""
    text = program if isinstance(program, str) else program.as_text()
    replay = _Replay(Module(text), chip, placement or Placement(), _partitions(text))
    total = replay.computation(replay.module.entry)[0]
    breakdown = {k: v for k, v in sorted(total.categories.items(), key=lambda kv: -kv[1]) if v}
    costs = sorted(total.instructions.values(), key=lambda c: -c.seconds)
    return StepTimePrediction(
        chip=chip.name,
        peak_bf16_flops=chip.peak_flops["bf16"],
        seconds=total.seconds,
        bound=next(iter(breakdown), "none"),
        breakdown=breakdown,
        top=costs[:top],
        flops=total.flops,
        hbm_bytes=total.hbm_bytes,
        unknown_kernels=sorted(replay.module.unknown_kernels),
        notes=sorted(replay.notes),
    )


def _partitions(text: str) -> int:
    found = re.search(r"\bnum_partitions=(\d+)", text)
    return int(found[1]) if found else 1


@dataclass
class _Time:
    """What replaying part of a program found: its seconds, by category and instruction."""

    seconds: float = 0.0
    categories: collections.Counter = field(default_factory=collections.Counter)
    instructions: dict[str, Cost] = field(default_factory=dict)
    flops: float = 0.0
    hbm_bytes: float = 0.0

    def add(self, other: _Time, times: float = 1.0) -> None:
        self.seconds += times * other.seconds
        self.flops += times * other.flops
        self.hbm_bytes += times * other.hbm_bytes
        for key, value in other.categories.items():
            self.categories[key] += times * value
        for cost in other.instructions.values():
            self.charge(cost, times * cost.seconds)

    def charge(self, cost: Cost, seconds: float) -> None:
        """Counts `seconds` of the step against an instruction (and its category)."""
        known = self.instructions.get(cost.instruction)
        spent = seconds + (known.seconds if known else 0.0)
        self.instructions[cost.instruction] = dataclasses.replace(cost, seconds=spent)


def _wait(part: _Time, cost: Cost, seconds: float) -> None:
    """Counts `seconds` of the step against an instruction and its category."""
    part.charge(cost, seconds)
    part.categories[cost.category] += seconds


@dataclass
class _Transfer:
    finish: float
    cost: Cost


class _Replay:
    """Replays a module's schedule on a chip (see the module docstring)."""

    def __init__(self, module: Module, chip: Chip, placement: Placement, partitions: int):
        self.module, self.chip, self.placement = module, chip, placement
        self.partitions = partitions
        self.notes: set[str] = set()

    def computation(self, name: str, passes: int = 1) -> list[_Time]:
        """A control computation (the ENTRY, a loop body, a branch) replayed `passes` times in
        a row, each pass's time apart: a loop's second pass is its steady state, transfers
        the first started still in flight. What is in flight at the end is waited for."""
        body = self.module.computations.get(name, [])
        clock, busy = 0.0, collections.defaultdict(float)
        flight: dict[str, _Transfer] = {}
        times = []
        for _ in range(passes):
            part, start = _Time(), clock
            for ins in body:
                clock = self._step(ins, part, clock, busy, flight)
            part.seconds = clock - start
            times.append(part)
        for transfer in flight.values():
            if transfer.finish > clock:
                _wait(times[-1], transfer.cost, transfer.finish - clock)
                times[-1].seconds += transfer.finish - clock
                clock = transfer.finish
        return times

    def _step(self, ins: Instruction, part: _Time, clock, busy, flight) -> float:
        """Replays one instruction; returns the clock after it."""
        if ins.opcode in _FREE or _FREE_CALLS.search(ins.attributes):
            return clock
        if ins.opcode in ("while", "conditional", "call"):
            inner = self._control(ins)
            part.add(inner)
            return clock + inner.seconds
        if (transfer := self._transfer(ins)) is not None:
            key, link, seconds, cost = transfer
            busy[link] = max(clock, busy[link]) + seconds
            flight[key] = _Transfer(busy[link], cost)
            return clock
        if (done := self._done_key(ins)) is not None:
            waiting = flight.pop(done, None)
            if waiting is None or waiting.finish <= clock:
                return clock
            _wait(part, waiting.cost, waiting.finish - clock)
            return waiting.finish
        seconds = 0.0
        collective = self._collective(ins) or self._fused_sync_collective(ins, flight)
        if collective is not None:  # synchronous: the program waits for it
            seconds, cost = collective
            _wait(part, cost, seconds)
        if ins.opcode in collectives.COLLECTIVES:
            return clock + seconds
        compute, cost, flops, hbm = self._compute(ins)
        _wait(part, cost, compute)
        part.flops += flops
        part.hbm_bytes += hbm
        return clock + seconds + compute

    # ---- control flow ------------------------------------------------------------------

    def _control(self, ins: Instruction) -> _Time:
        """A loop (once per trip), a conditional (its most expensive branch) or a call."""
        total = _Time()
        if ins.opcode == "while":
            body = re.search(r"\bbody=%([\w.\-]+)", ins.attributes)[1]
            trips = trip_count(ins.attributes, self.module.text_lines)
            if trips is None:
                self.notes.add("a loop whose trip count only the run knows counts one trip")
                trips = 1
            first, *steady = self.computation(body, passes=min(trips, 2))
            total.add(first)
            for later in steady:
                total.add(later, trips - 1)
        elif ins.opcode == "conditional":
            branches = [self.computation(name)[0] for name in callees(ins.attributes)]
            total.add(max(branches, key=lambda t: t.seconds, default=_Time()))
        elif callee := self.module.callee(ins):
            total.add(self.computation(callee)[0])
        return total

    # ---- compute ----------------------------------------------------------------------

    def _compute(self, ins: Instruction) -> tuple[float, Cost, float, int]:
        flops, dtype = self.module.flops(ins.name)
        hbm, host = self.module.hbm_bytes(ins)
        matmul = flops / self.chip.peak(dtype)
        memory = hbm / self.chip.hbm_bytes_per_s + host / self.chip.host_bytes_per_s
        what = _describe(ins)
        category = "matmul" if matmul >= memory and flops else "memory"
        return max(matmul, memory), Cost(ins.name, what, category, 0.0), flops, hbm

    # ---- transfers --------------------------------------------------------------------

    def _transfer(self, ins: Instruction) -> tuple[str, str, float, Cost] | None:
        """(key its done names, link, seconds, cost) of an instruction starting a transfer."""
        if ins.opcode == "copy-start":
            arrays = [a for o in ins.operands for a in self.module.operand_arrays(o)]
            arrays += ins.results[:1]
            return self._copy(ins, arrays)
        if ins.opcode == "send" and collectives.MEGASCALE.search(ins.attributes):
            moved = sum(a.nbytes for a in ins.results[:1])
            seconds = moved / self._dcn()
            return ins.name, "dcn", seconds, Cost(ins.name, "send (DCN)", "dcn", 0.0)
        if ins.opcode.endswith("-start") and ins.opcode != "copy-start":
            callee = self.module.callee(ins)
            inner = self.module.computations.get(callee, []) if callee else []
            kind = next((i for i in inner if i.opcode in collectives.COLLECTIVES), None)
            if ins.opcode in collectives.COLLECTIVES or kind is not None:
                target = ins if ins.opcode in collectives.COLLECTIVES else kind
                seconds, cost = self._collective(target, start=ins)
                return ins.name, cost.category, seconds, cost
            if ins.opcode == "async-start" and inner:  # a host transfer (offload) or a copy
                moved = [a for i in inner for a in self._moved_arrays(i)]
                return self._copy(ins, moved)
            return None
        found = self._fused_collective(ins)
        if found is not None and found[1] == "start":
            seconds, cost = self._collective(found[0], start=ins)
            key = f"channel {collectives.channel(found[0].attributes)}"
            return key, cost.category, seconds, cost
        return None

    def _moved_arrays(self, ins: Instruction) -> list[hlo_costs.Array]:
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

    def _copy(self, ins: Instruction, arrays) -> tuple[str, str, float, Cost]:
        """An asynchronous copy: to or from the host's memory over the host link, else (into
        or out of the TPU core's memory) at HBM bandwidth."""
        spaces = {a.space for a in arrays}
        size = max((a.nbytes for a in arrays), default=0)
        if HOST in spaces:
            seconds = size / self.chip.host_bytes_per_s
            return ins.name, "host", seconds, Cost(ins.name, ins.opcode, "host transfers", 0.0)
        if spaces <= {VMEM}:
            return ins.name, "dma", 0.0, Cost(ins.name, ins.opcode, "copies", 0.0)
        seconds = size / self.chip.hbm_bytes_per_s
        return ins.name, "dma", seconds, Cost(ins.name, ins.opcode, "copies", 0.0)

    def _done_key(self, ins: Instruction) -> str | None:
        """The transfer an instruction waits for, if it is a done."""
        if _ASYNC_DONE.search(ins.opcode) and ins.operands:
            return ins.operands[0].partition("#")[0]
        found = self._fused_collective(ins)
        if found is not None and found[1] == "done":
            return f"channel {collectives.channel(found[0].attributes)}"
        return None

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

    def _fused_sync_collective(self, ins: Instruction, flight) -> tuple[float, Cost] | None:
        """A fusion holding a collective whose channel no start opened: a synchronous
        collective (the TPU compiler's reduce-scatter is an all-reduce fused with the slice
        each device keeps)."""
        found = self._fused_collective(ins)
        if found is None or found[1] != "other":
            return None
        collective, _ = found
        if f"channel {collectives.channel(collective.attributes)}" in flight:
            return None
        callee = self.module.computations[self.module.callee(ins)]
        scatter = collective.opcode == "all-reduce" and callee[-1].opcode == "dynamic-slice"
        return self._collective(collective, start=ins, scatter=scatter)

    def _collective(
        self, ins: Instruction, start: Instruction | None = None, scatter: bool = False
    ) -> tuple[float, Cost] | None:
        """(seconds on its links, cost) of a collective instruction; None for others."""
        kind = "reduce-scatter" if scatter else collectives.COLLECTIVES.get(ins.opcode)
        if kind is None:
            return None
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
        name = (start or ins).name
        return wire / bandwidth, Cost(name, f"{kind} {axes}", f"{network} {axes}", 0.0)

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


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _describe(ins: Instruction) -> str:
    """An instruction as the prediction names it: its opcode (a kernel call by the kernel's
    name) and the operation it comes from in the traced program, backward when autodiff
    transposed it."""
    if ins.opcode == "custom-call":
        return f"kernel {hlo_costs.kernel_name(ins)}"
    found = _OP_NAME.search(ins.attributes)
    if not found:
        return ins.opcode
    source = found[1].rsplit("/", 1)[-1]
    return f"{ins.opcode} {source}{' (backward)' if 'transpose(' in found[1] else ''}"


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
    over several slices is one slice's (the TPU compiler's multi-slice programs are), so its
    devices are the first slice's."""
    slices = tuple(getattr(d, "slice_index", 0) or 0 for d in mesh_devices)
    ours = [d for d, s in zip(mesh_devices, slices, strict=True) if s == slices[0]]
    coords = (
        tuple(tuple(d.coords) for d in ours) if all(hasattr(d, "coords") for d in ours) else None
    )
    shape = tuple(max(c[i] for c in coords) + 1 for i in range(len(coords[0]))) if coords else ()
    one_slice = len(ours) < len(mesh_devices)
    return Placement(
        coords=coords,
        slices=None if one_slice else slices,
        slice_shape=shape,
        mesh_shape=None if one_slice else mesh_shape,
    )


def summary(
    prediction: StepTimePrediction, tokens_per_step: int, chips: int, flops_per_token: float
) -> dict:
    """What `tools/benchmark.py --dry-run --compile` prints of a prediction: the step's
    seconds, tokens/s and model TFLOP/s per chip and MFU at that step time (model FLOPs as the
    run counts them: no remat recomputation), what bounds it, the seconds by category, and
    the five most expensive instructions."""
    tokens = tokens_per_step / prediction.seconds / chips
    tflops = tokens * flops_per_token / 1e12
    peak = prediction.peak_bf16_flops / 1e12
    return {
        "chip": prediction.chip,
        "step_s": _digits(prediction.seconds),
        "tokens_per_sec_per_chip": round(tokens, 1),
        "tflops_per_chip": round(tflops, 1),
        "mfu": round(tflops / peak, 4),
        "bound": prediction.bound,
        "seconds_by_category": {k: _digits(v) for k, v in prediction.breakdown.items()},
        "top_instructions": [
            {"instruction": c.instruction, "what": c.what, "s": _digits(c.seconds)}
            for c in prediction.top
        ],
        "matmul_tflop_per_chip": round(prediction.flops / 1e12, 3),
        "hbm_gb_per_chip": round(prediction.hbm_bytes / 1e9, 2),
        "unknown_kernels": prediction.unknown_kernels,
        "notes": prediction.notes,
    }


def _digits(seconds: float) -> float:
    """Four significant digits: a tiny model's 79 microseconds as much as a 3.4 s step."""
    return float(f"{seconds:.4g}")
