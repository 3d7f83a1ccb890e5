"""Compiling a plan's candidates: each in its own process (`python -m maxtrain.planning.worker`,
a TPU topology's libtpu loads once per process and a compile holds one core), at most
`processes` at a time, a progress line on stderr, a time budget after which what still runs
is stopped, and a cache of each compile's verdict keyed by the resolved config, the topology
and the code's version, so a second plan of the same candidates compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from maxtrain.common import files
from maxtrain.training import compile_cache

PACKAGE = Path(__file__).resolve().parents[1]  # maxtrain/


@dataclass
class Job:
    """One compile: the config with these overrides, for a topology of `slices` slices."""

    config: str
    overrides: list[str]
    topology: str
    slices: int
    resolved: str  # the resolved config's JSON: what the cache key reads of the job
    result: dict | None = None  # the worker's verdict, or {"skipped": why}
    cached: bool = False
    log: list[str] = field(default_factory=list)

    def key(self) -> str:
        identity = json.dumps([self.resolved, self.topology, self.slices, code_version()])
        return hashlib.sha256(identity.encode()).hexdigest()[:32]


_VERSION: list[str] = []


def code_version() -> str:
    """A digest of what decides a compile's verdict besides the config: maxtrain's source and
    the versions of jax, jaxlib and the TPU compiler."""
    if not _VERSION:
        digest = hashlib.sha256()
        for path in sorted(PACKAGE.rglob("*.py")):
            digest.update(path.read_bytes())
        for package in ("jax", "jaxlib", "libtpu"):
            try:
                digest.update(metadata.version(package).encode())
            except metadata.PackageNotFoundError:
                digest.update(b"-")
        _VERSION.append(digest.hexdigest()[:16])
    return _VERSION[0]


def cache_dir() -> Path:
    return compile_cache.root() / "plans"


def run_jobs(
    groups: Iterable[list[Job]],
    processes: int,
    budget_s: float,
    say=None,
    limit: int | None = None,
    pass_over=None,
) -> None:
    """Takes the groups (one candidate's compiles each) in order, at most `limit` of them, and
    fills each job's result: from the cache, else compiled. A group `pass_over(group)` names a
    reason for, from the verdicts so far, is not taken: its jobs get {"skipped": reason}. What
    the budget leaves uncompiled gets {"skipped": "time budget"}; groups beyond the limit keep
    no result."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    _Pool(processes, budget_s, say).run(iter(groups), limit, pass_over or (lambda group: None))


class _Pool:
    """At most `processes` workers at a time; stops them all when the budget is spent."""

    def __init__(self, processes: int, budget_s: float, say):
        self.processes, self.budget_s, self.say = processes, budget_s, say
        self.start = time.monotonic()
        self.running: list[tuple[Job, subprocess.Popen, Path, Path]] = []
        self.taken = self.passed_over = self.cached = self.done = 0

    def run(self, groups: Iterator[list[Job]], limit: int | None, pass_over) -> None:
        queue: list[Job] = []  # the taken groups' jobs not yet started
        more, last = True, 0.0
        while queue or self.running or more:
            while len(self.running) < self.processes and not self._spent():
                if queue:
                    self._launch(queue.pop(0))
                    continue
                group = next(groups, None) if more and self.taken != limit else None
                if group is None:
                    more = False
                    break
                if why := pass_over(group):
                    for job in group:
                        job.result = {"skipped": why}
                    self.passed_over += 1
                    continue
                self.taken += 1
                queue = [job for job in group if not self._from_cache(job)]
            if self._spent():
                self._stop_all(queue)
                return
            if self.running:
                time.sleep(0.5)
                self._reap()
            if time.monotonic() - last > 15 or not (queue or self.running or more):
                last = time.monotonic()
                self.say(self._progress())

    def _from_cache(self, job: Job) -> bool:
        path = cache_dir() / f"{job.key()}.json"
        if not path.is_file():
            return False
        job.result, job.cached = json.loads(path.read_text()), True
        self.cached += 1
        return True

    def _spent(self) -> bool:
        return time.monotonic() - self.start > self.budget_s

    def _progress(self) -> str:
        elapsed = time.monotonic() - self.start
        return (
            f"plan: {self.taken} candidates taken, {self.passed_over} passed over; "
            f"{self.cached} compiles from the cache, {self.done} compiled, "
            f"{len(self.running)} compiling; {elapsed:.0f} s of the {self.budget_s:.0f} s budget"
        )

    def _launch(self, job: Job) -> None:
        out = Path(tempfile.mkstemp(prefix="maxtrain-plan-", suffix=".json")[1])
        log = out.with_suffix(".log")
        request = json.dumps(
            {
                "config": job.config,
                "overrides": job.overrides,
                "topology": job.topology,
                "slices": job.slices,
                "out": str(out),
            }  # fmt: skip
        )
        with log.open("w") as stderr:
            worker = subprocess.Popen(
                [sys.executable, "-m", "maxtrain.planning.worker", request],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        self.running.append((job, worker, out, log))

    def _reap(self) -> None:
        for entry in list(self.running):
            job, worker, out, log = entry
            if worker.poll() is None:
                continue
            self.running.remove(entry)
            self.done += 1
            errors = log.read_text().strip().splitlines()
            log.unlink(missing_ok=True)
            if worker.returncode == 0 and out.stat().st_size:
                job.result = json.loads(out.read_text())
                _store(job)
            else:
                why = errors[-1] if errors else f"exit status {worker.returncode}"
                job.result = {"failed": why}
            out.unlink(missing_ok=True)

    def _stop_all(self, pending: list[Job]) -> None:
        """The budget is spent: the workers this pool started are stopped, one by one, and the
        taken groups' jobs not started are skipped."""
        for job, worker, out, log in self.running:
            worker.kill()
            worker.wait()
            out.unlink(missing_ok=True)
            log.unlink(missing_ok=True)
            job.result = {"skipped": "time budget"}
        for job in pending:
            job.result = {"skipped": "time budget"}
        self.say(f"plan: the {self.budget_s:.0f} s budget is spent; {len(pending)} not started")
        self.running = []


def _store(job: Job) -> None:
    """A verdict kept for the next plan (a failed compile is not: it may be this machine's)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    files.write_atomic(cache_dir() / f"{job.key()}.json", json.dumps(job.result))
