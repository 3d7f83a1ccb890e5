"""What a run does after a NaN/inf loss or gradient (train.on_nonfinite), and which checkpoint
it leaves to resume from.

The step itself already dropped such an update (training/step.py), so the state stays finite.
From each step's `finite` flag this module decides what follows:

- stop (the default): the run ends at the first non-finite step: one line, exit status 1.
- skip: each non-finite step is a warning on stderr with the count of skips in a row; more than
  train.max_consecutive_skips in a row end the run as stop does. A run that skips every step
  would otherwise go on in silence.

Which checkpoints are finite. The checkpoint of step j holds the state after j updates, and only
step j + 1 computes a loss on it. So when steps s, s + 1, ... go non-finite, the state saved at
step s - 1 is the one that gave the first bad loss (a run resumed from it fails again at once),
and so is every state saved during the streak. Ending the run moves those aside
(`<step>.nonfinite-<time>`) and names the newest checkpoint before them.

Flags are read one step late: step k's after step k + 1 has been dispatched, so the host never
holds the device idle between steps. Before a save the step's own flag is read (the save waits
for the device anyway), so under stop a non-finite step is never saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from maxtrain.config import TrainConfig


class NonFiniteLoss(Exception):
    """The run ends because of non-finite losses (train.on_nonfinite); the CLI exits 1.

    first, last: the steps of the streak that ended it. kept: what the message says about the
    checkpoint to resume from, filled in once the unusable ones were moved aside.
    """

    def __init__(self, first: int, last: int, cfg: TrainConfig):
        super().__init__(first, last)
        self.first, self.last, self.cfg = first, last, cfg
        self.kept = "no checkpoint was saved"

    def __str__(self) -> str:
        if self.cfg.on_nonfinite == "stop":
            what = f"the loss is not finite at step {self.last} (train.on_nonfinite=stop)"
            fix = "; lower optim.lr, or set train.on_nonfinite=skip to drop such updates"
        else:
            what = (
                f"the loss was not finite at {self.last - self.first + 1} steps in a row "
                f"({self.first}-{self.last}), more than train.max_consecutive_skips="
                f"{self.cfg.max_consecutive_skips}"
            )
            fix = "; lower optim.lr"
        return f"{what}; {self.kept}{fix}"


class NonFiniteWatch:
    """Reads each step's `finite` flag (one step late, see the module docstring), warns about
    skipped updates and raises NonFiniteLoss when the run must end.

    warn: where skip warnings go (process 0's stderr; a no-op on the other processes).
    """

    def __init__(self, cfg: TrainConfig, warn: Callable[[str], None]):
        self.cfg, self.warn = cfg, warn
        self.streak = 0  # non-finite steps in a row, up to the newest step read
        self._unread: list[tuple[int, Any]] = []  # (step, its finite flag on the device)

    def after_step(self, step: int, finite: Any) -> None:
        """Called once step `step` is dispatched: reads the flags of the steps before it."""
        self._read(through=step - 1)
        self._unread.append((step, finite))

    def settle(self, step: int) -> None:
        """Reads every flag through `step`, waiting for the device: before a save, at the end."""
        self._read(through=step)

    def _read(self, through: int) -> None:
        while self._unread and self._unread[0][0] <= through:
            step, finite = self._unread.pop(0)
            self._record(step, bool(finite))

    def _record(self, step: int, finite: bool) -> None:
        if finite:
            self.streak = 0
            return
        self.streak += 1
        if self.cfg.on_nonfinite == "stop" or self.streak > self.cfg.max_consecutive_skips:
            raise NonFiniteLoss(step - self.streak + 1, step, self.cfg)
        self.warn(
            f"the loss is not finite at step {step}; its update was skipped ({self.streak} in a "
            f"row; more than train.max_consecutive_skips={self.cfg.max_consecutive_skips} "
            "stop the run)"
        )
