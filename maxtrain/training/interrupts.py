"""SIGTERM and Ctrl-C (SIGINT) stop a run after the current step, saved; a second Ctrl-C aborts.

SIGTERM is a preemption notice (a VM about to go, a scheduler's notice) and Ctrl-C a person at
a terminal; both mean "stop soon, lose nothing". The loop finishes the step it is in, saves it
to the local tier (durable before the exit), prints one line and exits: 0 after SIGTERM, as
schedulers expect of a clean preemption, 130 after SIGINT, the shell's code for Ctrl-C. A
second Ctrl-C means "now": one line, exit 130 at once, nothing more saved (the previous
checkpoint stays the resume point, and Orbax removes a save that was in flight when the tier
next opens; grain's workers follow the trainer, see maxtrain/data/grain_pipeline.py).

Several processes: a notice may reach one host only, or hosts at different steps, and a
process that stops alone leaves the others waiting in a collective. jax.distributed's
preemption service (on by default) catches SIGTERM on any host and makes
`reached_preemption_sync_point` true on every process at the same step, so all of them save
that step and exit together. Its C++ handler must keep SIGTERM, so no Python handler is
installed for it; a Ctrl-C is passed on to it as a SIGTERM to this process, so it stops every
process at one step too (those it did not reach exit 0).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from jax.experimental import multihost_utils

EXIT_STATUS = {"SIGTERM": 0, "SIGINT": 130}


class StopSignals:
    """Turns SIGTERM and SIGINT into "stop after this step", the same step on every process.

    Use as a context manager around the train loop and its final save; `stop_after(step)` after
    every step; `signal_name` says what stopped the run (None: the loop ran to its end).
    """

    def __init__(self, process_count: int = 1):
        self.stopped = False
        self.signal_name: str | None = None
        self._synced = process_count > 1
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
            if not self._synced:
                self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._terminate)
        return self

    def _terminate(self, signum, frame) -> None:
        self.signal_name = self.signal_name or "SIGTERM"

    def _interrupt(self, signum, frame) -> None:
        if self.signal_name == "SIGINT":  # the second Ctrl-C
            abort("interrupted again (SIGINT): exiting now, without saving")
        self.signal_name = "SIGINT"
        # os.write, not print: a handler may run in the middle of another print to stderr.
        line = "maxtrain: interrupted (SIGINT): saving after this step; Ctrl-C again exits at once"
        os.write(sys.stderr.fileno(), f"{line}\n".encode())
        if self._synced:  # jax's preemption service stops every process at one step
            os.kill(os.getpid(), signal.SIGTERM)

    def stop_after(self, step: int) -> bool:
        """Called after every step, on every process."""
        if self._synced:
            self.stopped = multihost_utils.reached_preemption_sync_point(step)
            if self.stopped and self.signal_name is None:
                self.signal_name = "SIGTERM"  # the notice reached another process
        else:
            self.stopped = self.signal_name is not None
        return self.stopped

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def abort(line: str) -> None:
    """Prints `maxtrain: <line>` and exits 130 at once: no cleanup, no waiting for saves."""
    print(f"maxtrain: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_STATUS["SIGINT"])
