"""How long one execution of a compiled program takes on a chip, predicted from the program
alone: `predict(program, chip, placement) -> StepTimePrediction` (seconds, what bounds it, the
seconds by category, the most expensive instructions). docs/step-time.md states the model, what
it leaves out, and how it compares with measured steps.

The model replays the program's own schedule (a compiled program's text lists each
computation's instructions in the order the compiler scheduled them):
  compute     each instruction takes the longer of its matmul FLOPs at the chip's peak for
              their operand dtype and its HBM bytes at the chip's HBM bandwidth
              (hlo_costs.py), one after another; a fusion is one instruction; a loop's body
              counts once per trip (the trip count the program states), a conditional as its
              most expensive branch;
  transfers   collectives over the links their groups span, copies to the host's memory over
              the host link (transfers.py);
  overlap     a transfer the program makes asynchronous runs on its link from its start,
              beside the compute scheduled before its done, and the done waits for it: only
              what is left then counts. Transfers on one link queue one after another. A
              synchronous collective counts whole.
A loop is replayed twice in a row, so that transfers its schedule carries from one trip into
the next overlap as in steady state: its time is the first trip and the trip count less one
times the second.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from dataclasses import dataclass, field

from maxtrain.analysis import hlo_costs
from maxtrain.analysis.hlo_costs import Instruction, Module
from maxtrain.analysis.program import callees, trip_count
from maxtrain.analysis.transfers import Links, Placement, Transfer
from maxtrain.common.devices import Chip

_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
    "recv", "recv-done", "send-done",
})  # fmt: skip
_FREE_CALLS = re.compile(r'custom_call_target="(AllocateBuffer|ConcatBitcast)"')  # no traffic


@dataclass(frozen=True)
class Cost:
    """One instruction's share of the predicted step."""

    instruction: str
    what: str  # its opcode and the operation it comes from, a kernel, a collective's axes
    category: str  # matmul, memory, collectives <axes>, host transfers, ...
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
    kernels: dict[str, float] = field(default_factory=dict)  # seconds per hand-written kernel
    unknown_kernels: list[str] = field(default_factory=list)  # kernels counted no FLOPs
    notes: list[str] = field(default_factory=list)


def predict(
    program: str | object, chip: Chip, placement: Placement | None = None, top: int = 5
) -> StepTimePrediction:
    """The step time of a compiled program (its text, or a jax `Compiled`) on `chip`."""
    text = program if isinstance(program, str) else program.as_text()
    partitions = re.search(r"\bnum_partitions=(\d+)", text)
    module = Module(text)
    links = Links(module, chip, placement or Placement(), int(partitions[1]) if partitions else 1)
    replay = _Replay(module, chip, links)
    total = replay.computation(module.entry)[0]
    breakdown = {k: v for k, v in sorted(total.categories.items(), key=lambda kv: -kv[1]) if v}
    kernels = collections.Counter()
    for cost in total.instructions.values():
        if cost.what.startswith("kernel "):
            kernels[cost.what.removeprefix("kernel ")] += cost.seconds
    return StepTimePrediction(
        chip=chip.name,
        peak_bf16_flops=chip.peak_flops["bf16"],
        seconds=total.seconds,
        bound=next(iter(breakdown), "none"),
        breakdown=breakdown,
        top=sorted(total.instructions.values(), key=lambda c: -c.seconds)[:top],
        flops=total.flops,
        hbm_bytes=total.hbm_bytes,
        kernels=dict(kernels.most_common()),
        unknown_kernels=sorted(module.unknown_kernels),
        notes=sorted(replay.notes | links.notes),
    )


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
            self.charge(cost, times * cost.seconds, category=False)

    def charge(self, cost: Cost, seconds: float, category: bool = True) -> None:
        """Counts `seconds` of the step against an instruction (and its category)."""
        known = self.instructions.get(cost.instruction)
        spent = seconds + (known.seconds if known else 0.0)
        self.instructions[cost.instruction] = dataclasses.replace(cost, seconds=spent)
        if category:
            self.categories[cost.category] += seconds


def _cost(transfer: Transfer) -> Cost:
    return Cost(transfer.key, transfer.what, transfer.category, 0.0)


class _Replay:
    """Replays a module's schedule on a chip (see the module docstring)."""

    def __init__(self, module: Module, chip: Chip, links: Links):
        self.module, self.chip, self.links = module, chip, links
        self.notes: set[str] = set()

    def computation(self, name: str, passes: int = 1) -> list[_Time]:
        """A control computation (the ENTRY, a loop body, a branch) replayed `passes` times in
        a row, each pass's time apart: a loop's second pass is its steady state, with what the
        first left in flight. What is in flight at the end is waited for."""
        clock, busy = 0.0, collections.defaultdict(float)
        flight: dict[str, tuple[float, Cost]] = {}  # key -> (when it finishes, its cost)
        times = []
        for _ in range(passes):
            part, start = _Time(), clock
            for ins in self.module.computations.get(name, []):
                clock = self._step(ins, part, clock, busy, flight)
            part.seconds = clock - start
            times.append(part)
        for finish, cost in flight.values():
            if finish > clock:
                times[-1].charge(cost, finish - clock)
                times[-1].seconds += finish - clock
                clock = finish
        return times

    def _step(self, ins: Instruction, part: _Time, clock, busy, flight) -> float:
        """Replays one instruction; returns the clock after it."""
        if ins.opcode in _FREE or _FREE_CALLS.search(ins.attributes):
            return clock
        if ins.opcode in ("while", "conditional", "call"):
            inner = self._control(ins)
            part.add(inner)
            return clock + inner.seconds
        if (transfer := self.links.start(ins)) is not None:
            busy[transfer.link] = max(clock, busy[transfer.link]) + transfer.seconds
            flight[transfer.key] = (busy[transfer.link], _cost(transfer))
            return clock
        if (done := self.links.done(ins)) is not None:
            finish, cost = flight.pop(done, (clock, None))
            if finish > clock:
                part.charge(cost, finish - clock)
            return max(clock, finish)
        waited = 0.0
        if (collective := self.links.synchronous(ins)) is not None:
            waited = collective.seconds
            part.charge(_cost(collective), waited)
            if ins.opcode != "fusion":  # a fusion's computation follows its collective
                return clock + waited
        seconds, cost, flops, hbm = self._compute(ins)
        part.charge(cost, seconds)
        part.flops += flops
        part.hbm_bytes += hbm
        return clock + waited + seconds

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

    def _compute(self, ins: Instruction) -> tuple[float, Cost, float, int]:
        """(seconds, cost, matmul FLOPs, HBM bytes) of an instruction run on the core."""
        flops, dtype = self.module.flops(ins.name)
        hbm, host = self.module.hbm_bytes(ins)
        matmul = flops / self.chip.peak(dtype)
        memory = hbm / self.chip.hbm_bytes_per_s + host / self.chip.host_bytes_per_s
        category = "matmul" if matmul >= memory and flops else "memory"
        return max(matmul, memory), Cost(ins.name, _describe(ins), category, 0.0), flops, hbm


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
        "kernels_s": {name: _digits(seconds) for name, seconds in prediction.kernels.items()},
        "unknown_kernels": prediction.unknown_kernels,
        "notes": prediction.notes,
    }


def _digits(seconds: float) -> float:
    """Four significant digits: a tiny model's 79 microseconds as much as a 3.4 s step."""
    return float(f"{seconds:.4g}")
