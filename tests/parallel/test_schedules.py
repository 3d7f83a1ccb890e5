"""The schedules' tables (parallel/schedules.py): what the program relies on, what each schedule
promises for memory and idle time, in numbers read off the tables (no program is compiled)."""

import numpy as np
import pytest

from maxtrain.parallel import schedules
from maxtrain.parallel.schedules import BACKWARD, FORWARD, IDLE, PASSES, WEIGHT

SHAPES = [(2, 1, 8), (4, 1, 8), (4, 1, 16), (3, 1, 5), (4, 2, 8), (2, 3, 4)]  # (S, R, M)
REPEATING = ("circular", "interleaved_1f1b")  # the others run one block of layers per stage
CASES = [
    (schedule, *shape)
    for schedule in schedules.SCHEDULES
    for shape in SHAPES
    if shape[1] == 1 or schedule in REPEATING
]


@pytest.mark.parametrize("schedule, S, R, M", CASES)
def test_every_table_runs_each_unit_once_per_slot_in_dependency_order(schedule, S, R, M):
    if schedule == "interleaved_1f1b" and M % S:
        with pytest.raises(ValueError, match="blocks of the"):
            schedules.build(schedule, S, R, M)
        return
    table = schedules.build(schedule, S, R, M)
    schedules.check(table)  # raises on a unit run twice, missed, or out of order
    for slot, grid in table.units.items():  # a slot reads its buffer only where it works
        if slot == FORWARD:
            continue
        reads = table.inputs[1] if slot == BACKWARD else table.pending[1]
        assert ((grid == IDLE) == (reads == IDLE)).all(), slot


@pytest.mark.parametrize("S", [2, 4])
def test_one_f_one_b_holds_at_most_2S_minus_1_micro_batches_whatever_M(S):
    """GPipe keeps every micro-batch's layer inputs until the backward turns; 1F1B's stage s
    keeps 2 (S - s) - 1, the first stage the most."""
    for M in (S, 2 * S, 4 * S):
        assert schedules.build("gpipe", S, 1, M).in_flight() == M
        table = schedules.build("1f1b", S, 1, M)
        held = [int(table.inputs[0][:, s].max()) + 1 for s in range(S)]
        assert held == [min(M, 2 * (S - s) - 1) for s in range(S)]


@pytest.mark.parametrize("S, R, M", [(2, 1, 8), (4, 1, 8), (4, 2, 8), (4, 1, 16)])
def test_idle_shares_by_the_formulas(S, R, M):
    """With every pass over a unit's layers alike (docs/pipeline.md), gpipe, circular, 1f1b and
    interleaved_1f1b idle (S - 1) / (R M + S - 1); zero bubble 2 (S - 1) / (3 M + 2 (S - 1)):
    its weight gradients leave the S - 1 ramp ticks."""
    names = ("circular", "interleaved_1f1b") if R > 1 else ("gpipe", "1f1b", "zero_bubble")
    for name in names:
        table = schedules.build(name, S, R, M)
        want = (S - 1) / (R * M + S - 1)
        if name == "zero_bubble":
            want = 2 * (S - 1) / (3 * M + 2 * (S - 1))
        assert table.idle_share(PASSES) == pytest.approx(want), name


def test_zero_bubble_weight_slot_is_live_in_M_ticks_each_full():
    """Each weight gradient waits for the tick stage 0 takes the micro-batch's input gradient:
    M ticks in which every stage has one, and one more pending unit per later stage."""
    S, M = 4, 8
    table = schedules.build("zero_bubble", S, 1, M)
    weight = table.units[WEIGHT]
    live = [t for t in range(table.ticks) if (weight[t] != IDLE).any()]
    assert len(live) == M and all((weight[t] != IDLE).all() for t in live)
    pending = [int(table.pending[0][:, s].max()) + 1 for s in range(S)]
    assert pending == [1, 2, 3, 4]
    np.testing.assert_array_equal(
        table.units[FORWARD], schedules.build("1f1b", S, 1, M).units[FORWARD]
    )
