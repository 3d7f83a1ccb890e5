"""Pipeline schedules as tables: at each tick, which unit of work each stage does in each slot.

A unit is one micro-batch m through one of a stage's R chunks of layers (chunk r holds the
stage's group of repeat r: parallel/pipeline.py), numbered r * M + m. There are three kinds of
work, each a slot of the tick:

    forward   the chunk's layers on the unit's activations
    backward  their gradient: with respect to the activations and the weights together, or,
              where the schedule splits the backward (zero bubble), the activations' alone
    weight    the weights' gradient, apart from the backward (zero bubble only)

One SPMD program runs a schedule: every stage runs the same ticks with the same slots, each on
its own unit or on nothing (a masked slot), because every device must run the same collectives
in the same order (the stage's layers hold fsdp's gathers, tensor's reductions and the
experts' exchanges), so a stage cannot branch to other work than its neighbours'. A tick's
time is therefore the sum of its live slots, and a stage idles where its slot is masked. After
each tick the forward outputs move one stage on and the backward outputs one stage back, one
collective-permute each: a unit's next step runs exactly one tick after its previous one, so
nothing waits in a queue (the tables are built so; `check` asserts it).

The schedules (docs/pipeline.md holds the pictures and the measured idle shares):

- gpipe / circular: every forward, then every backward, as the automatic derivative of the
  forward scan (parallel/pipeline.py run): all R * M units' activations alive at the turn.
- 1f1b: unit u's forward on stage s at tick u + s; its backward on the last stage in the tick
  its forward ends there (the loss's gradient is taken in between), then one stage back per
  tick. Stage s holds the inputs of 2 (S - s) - 1 units between their forward and backward:
  at most 2S - 1, whatever M (one-op-per-tick 1F1B, with stages working asynchronously, holds
  S; here a unit's round trip is 2 (S - 1) ticks of both slots).
- interleaved_1f1b: 1f1b over R chunks per stage, the units taken in Megatron's order: blocks
  of S micro-batches through chunk 0, then chunk 1, ..., so a unit leaving the last stage
  enters stage 0's next chunk in the next tick. M must be a multiple of S.
- zero_bubble: ZB-H1 (Qi et al., 2023). 1f1b's table with the backward split: the input
  gradient keeps 1f1b's place (it is the critical path) and each weight gradient waits for
  the tick in which stage 0 takes that micro-batch's input gradient, the same tick on every
  stage, so the weight slot is live in M ticks only, all of them full, where 1f1b's combined
  backward is live in M + S - 1. ZB-V's further gain over ZB-H1 comes from a second chunk per
  stage run in a V across the stages; here chunks are what interleaved_1f1b already adds, and
  the V would send activations both ways around the ring in every tick.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORWARD, BACKWARD, WEIGHT = "forward", "backward", "weight"
SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
IDLE = -1
# The passes over a unit's layers each slot kind makes when each pass costs alike: the whole
# backward is the input gradient and the weight gradient (`Table.idle_share`'s formula value).
PASSES = {FORWARD: 1.0, BACKWARD: 2.0, WEIGHT: 1.0}


@dataclass(frozen=True, eq=False)
class Table:
    """A schedule: per slot, [ticks, stages] unit numbers (IDLE where the slot is masked), and
    where each stage keeps what a unit's later slot needs.

    inputs: per tick and stage, the slot of the stage's buffer its forward's inputs go to and
    the slot its backward reads them from; pending: the same for what the input gradient leaves
    for the weight gradient (zero bubble). A slot is reused only after the tick that frees it.
    """

    schedule: str
    stages: int  # S
    repeats: int  # R
    microbatches: int  # M
    units: dict[str, np.ndarray]  # slot kind -> [ticks, stages]
    inputs: tuple[np.ndarray, np.ndarray]  # (written by forward, read by backward) [ticks, S]
    pending: tuple[np.ndarray, np.ndarray] | None  # (written by backward, read by weight)

    @property
    def ticks(self) -> int:
        return len(self.units[FORWARD])

    @property
    def splits_backward(self) -> bool:
        return WEIGHT in self.units

    def buffer_slots(self, which: tuple[np.ndarray, np.ndarray] | None) -> int:
        """How many slots a buffer needs (the largest slot used, plus one)."""
        return 0 if which is None else int(max(which[0].max(), which[1].max())) + 1

    def phases(
        self, slots: tuple[str, ...] | None = None
    ) -> list[tuple[int, int, tuple[str, ...]]]:
        """Runs of consecutive ticks with the same live slot kinds (those some stage uses), as
        (first tick, end tick, kinds in slot order): one loop of the program each. `slots`:
        only these kinds (the forward alone, for a pass without gradients)."""
        kinds = [k for k in (FORWARD, BACKWARD, WEIGHT) if k in self.units]
        kinds = [k for k in kinds if slots is None or k in slots]
        live = [
            tuple(k for k in kinds if (self.units[k][t] != IDLE).any()) for t in range(self.ticks)
        ]
        phases: list[tuple[int, int, tuple[str, ...]]] = []
        for t, here in enumerate(live):
            if phases and phases[-1][2] == here:
                phases[-1] = (phases[-1][0], t + 1, here)
            else:
                phases.append((t, t + 1, here))
        return [p for p in phases if p[2]]

    def idle_share(self, work: dict[str, float]) -> float:
        """The share of a step a stage spends on masked slots, every stage alike, given the
        work of one unit in each slot kind (`work`: kind -> seconds, FLOPs or passes; a split
        backward's input gradient is one pass where the whole backward is two): each phase's
        ticks cost the sum of its live slots' work."""
        if self.splits_backward and work is PASSES:
            work = {**work, BACKWARD: 1.0}
        spent = sum(
            (end - start) * sum(work[k] for k in kinds) for start, end, kinds in self.phases()
        )
        needed = self.repeats * self.microbatches * sum(work[k] for k in self.units)
        return 1.0 - needed / spent

    def in_flight(self) -> int:
        """The most units any stage holds the inputs of between their forward and backward."""
        return self.buffer_slots(self.inputs)


def build(schedule: str, stages: int, repeats: int, microbatches: int) -> Table:
    """The table of a schedule (the module docstring)."""
    S, R, M = stages, repeats, microbatches
    if schedule in ("gpipe", "circular"):
        return _autodiff(schedule, S, R, M)
    if schedule == "interleaved_1f1b" and M % S:
        raise ValueError(f"interleaved_1f1b takes micro-batches in blocks of the {S} stages")
    forward, backward = _one_f_one_b(S, R, M)
    units = {FORWARD: forward, BACKWARD: backward}
    if schedule == "zero_bubble":
        units[WEIGHT] = _deferred_weights(backward)
    table = Table(schedule, S, R, M, units, *_buffers(units, S))
    check(table)
    return table


def _order(S: int, R: int, M: int, reverse_chunks: bool) -> list[int]:
    """Units in the order a stage takes them: blocks of S micro-batches through chunk 0, 1, ...
    (R - 1, ..., 0 for the backward). With R = 1: micro-batch order."""
    order = []
    for u in range(R * M):
        block, within = divmod(u, R * S) if R > 1 else (0, u)
        chunk = within // S if R > 1 else 0
        m = block * S + within % S if R > 1 else within
        order.append((R - 1 - chunk if reverse_chunks else chunk) * M + m)
    return order


def _one_f_one_b(S: int, R: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward of the i-th unit on stage s at tick i + s; backward of the i-th unit (reverse
    chunk order) on stage s at tick i + R S - 1 + (S - 1 - s): the last stage takes a unit's
    last chunk backward in the tick its forward ends there."""
    forward_order, backward_order = _order(S, R, M, False), _order(S, R, M, True)
    ticks = R * M + R * S + S - 2
    forward = np.full((ticks, S), IDLE)
    backward = np.full((ticks, S), IDLE)
    for i, (f, b) in enumerate(zip(forward_order, backward_order, strict=True)):
        for s in range(S):
            forward[i + s, s] = f
            backward[i + R * S - 1 + S - 1 - s, s] = b
    return forward, backward


def _deferred_weights(backward: np.ndarray) -> np.ndarray:
    """Each unit's weight gradient, on every stage, in the tick stage 0 takes its input
    gradient (the last of its backward ticks)."""
    weight = np.full_like(backward, IDLE)
    for t, unit in enumerate(backward[:, 0]):
        if unit != IDLE:
            weight[t, :] = unit
    return weight


def _autodiff(schedule: str, S: int, R: int, M: int) -> Table:
    """gpipe / circular as jax runs them: R M + S - 1 forward ticks (unit u on stage s at tick
    u + s, parallel/pipeline.py), then the same ticks transposed, each a whole backward."""
    n = R * M + S - 1
    forward = np.full((2 * n, S), IDLE)
    backward = np.full((2 * n, S), IDLE)
    for u in range(R * M):
        for s in range(S):
            forward[u + s, s] = u
            backward[2 * n - 1 - (u + s), s] = u
    units = {FORWARD: forward, BACKWARD: backward}
    return Table(schedule, S, R, M, units, *_buffers(units, S))


def _buffers(
    units: dict[str, np.ndarray], S: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """Slots for the inputs (forward -> backward) and, with a weight slot, for what the input
    gradient leaves (backward -> weight), per stage: the lowest free slot, freed after the
    tick that last reads it."""

    def allocate(write: np.ndarray, read: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        written, taken = np.full_like(write, IDLE), np.full_like(read, IDLE)
        for s in range(S):
            held: dict[int, int] = {}  # unit -> slot
            for t in range(len(write)):
                if write[t, s] != IDLE:
                    free = min(set(range(len(held) + 1)) - set(held.values()))
                    held[write[t, s]] = written[t, s] = free
                if read[t, s] != IDLE:
                    taken[t, s] = held.pop(read[t, s])
        return written, taken

    inputs = allocate(units[FORWARD], units[BACKWARD])
    pending = allocate(units[BACKWARD], units[WEIGHT]) if WEIGHT in units else None
    return inputs, pending


def check(table: Table) -> None:
    """Asserts what the programs rely on: every stage runs every unit once in each slot kind,
    each after what it depends on (a unit's forward after its forward on the stage before, or
    its previous chunk's on the last stage; its backward after its forward, and after its
    backward on the next stage, or its next chunk's on the first; its weight gradient no
    earlier than its backward). In a table the program runs slot by slot (not gpipe's or
    circular's, which jax transposes), each step comes exactly one tick after the one it
    depends on, the loss's gradient in the very tick of the last forward: nothing waits."""
    S, R, M = table.stages, table.repeats, table.microbatches
    exact = table.schedule not in ("gpipe", "circular")
    at = {
        kind: {(s, int(u)): t for (t, s), u in np.ndenumerate(grid) if u != IDLE}
        for kind, grid in table.units.items()
    }
    for kind, seen in at.items():
        assert len(seen) == S * R * M, (kind, len(seen))

    def after(t: int, before: int, what: tuple) -> None:
        assert t == before + 1 if exact else t > before, what

    for (s, u), t in at[FORWARD].items():
        if s > 0:
            after(t, at[FORWARD][s - 1, u], ("forward", s, u))
        elif u >= M:
            after(t, at[FORWARD][S - 1, u - M], ("forward", s, u))
    for (s, u), t in at[BACKWARD].items():
        if s < S - 1:
            after(t, at[BACKWARD][s + 1, u], ("backward", s, u))
        elif u < (R - 1) * M:
            after(t, at[BACKWARD][0, u + M], ("backward", s, u))
        else:  # the loss's gradient
            assert t == at[FORWARD][s, u] if exact else t > at[FORWARD][s, u], ("loss", u)
        assert t >= at[FORWARD][s, u], ("backward before forward", s, u)
    for (s, u), t in at.get(WEIGHT, {}).items():
        assert t >= at[BACKWARD][s, u], ("weight before backward", s, u)
