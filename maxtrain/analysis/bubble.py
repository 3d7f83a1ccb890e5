"""A pipeline schedule's idle share, read from the compiled train step.

A schedule runs as loops over ticks (parallel/schedules.py: one per phase, a run of ticks with
the same live slots; gpipe and circular: the forward scan and its transpose). Each such loop's
body sends activations between stages, so the tick loops are the outermost loops whose own
body holds a collective-permute. From the program come each tick loop's trip count and its
matmul FLOPs per trip (per device: the slots' work on one stage, masked or not); matched in
order to the table's phases, these give the work of one unit in each slot kind (a phase's
FLOPs are the sum of its slots'), and the table then gives the share of the stage's work that
went to masked slots: `Table.idle_share` of the measured work.

A phase of one tick has no loop (XLA inlines a loop that runs once): its slots' work is
solved from the other phases, so a table whose longer phases leave a slot kind's work
undetermined (1f1b or zero bubble over 2 stages) cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maxtrain.analysis import program
from maxtrain.parallel.schedules import Table


@dataclass(frozen=True)
class TickLoop:
    name: str
    trips: int
    flops: float  # matmul FLOPs per trip, per device


@dataclass(frozen=True)
class Reading:
    idle_share: float
    work: dict[str, float]  # matmul FLOPs of one unit per slot kind, per device
    loops: tuple[TickLoop, ...]


def tick_loops(hlo_text: str) -> list[TickLoop]:
    """The outermost loops of a compiled program whose own body holds a collective-permute,
    in the order they run, with their trip counts and matmul FLOPs per trip."""
    ops = list(program.executed(hlo_text))
    times = {op.name: op.times for op in ops if op.opcode == "while"}
    sending = {
        op.loops[-1] for op in ops if op.opcode.startswith("collective-permute") and op.loops
    }
    ticks = [
        name
        for name in times
        if name in sending and not any(outer in sending for outer in _enclosing(ops, name))
    ]
    trips = {name: 0 for name in ticks}
    for op in ops:  # a body instruction runs trips times per run of its loop
        for name in ticks:
            if op.loops and op.loops[-1] == name:
                trips[name] = max(trips[name], op.times // times[name])
    flops = dict.fromkeys(ticks, 0)
    for dot, op in program.dots(hlo_text):
        for name in ticks:
            if name in op.loops:
                flops[name] += op.times * dot.flops
    return [TickLoop(n, trips[n], flops[n] / (times[n] * trips[n])) for n in ticks]


def _enclosing(ops: list[program.Executed], loop: str) -> tuple[str, ...]:
    """The loops a loop sits in."""
    return next(op.loops for op in ops if op.name == loop)


def read(hlo_text: str, table: Table) -> Reading:
    """The idle share of the schedule `table` in the compiled train step (module docstring).
    ValueError where the program's tick loops do not match the table's phases, or leave a slot
    kind's work undetermined."""
    phases = [(end - start, kinds) for start, end, kinds in table.phases() if end - start > 1]
    loops = tick_loops(hlo_text)
    if [trips for trips, _ in phases] != [loop.trips for loop in loops]:
        raise ValueError(
            f"the program's tick loops run {[loop.trips for loop in loops]} ticks, the "
            f"{table.schedule} table's phases {[trips for trips, _ in phases]}"
        )
    kinds = list(table.units)
    a = np.array([[kind in live for kind in kinds] for _, live in phases], float)
    if np.linalg.matrix_rank(a) < len(kinds):
        raise ValueError(
            f"the {table.schedule} table's phases over {table.stages} stages leave each slot's "
            "work undetermined (its phases of one tick have no loop)"
        )
    solved = np.linalg.lstsq(a, np.array([loop.flops for loop in loops]), rcond=None)[0]
    work = {kind: float(w) for kind, w in zip(kinds, solved, strict=True)}
    return Reading(table.idle_share(work), work, tuple(loops))
