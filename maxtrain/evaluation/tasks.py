"""Tasks: JSONL examples in the lm-evaluation-harness style, and their n-shot prompts.

A task is a directory with test.jsonl (the examples scored) and train.jsonl (where n-shot
examples come from), or a single JSONL file (then n-shot prompts draw from its other
examples). One example per line:

  {"context": "...", "choices": ["...", ...], "gold": 1}   multiple choice: which continuation
                                                          of the context is the most likely
  {"context": "...", "continuation": "..."}                completion: is the continuation what
                                                          greedy decoding gives, and how likely

A name without a path separator is one of the committed tasks (maxtrain/evaluation/tasks/,
made by tools/make_eval_tasks.py from the embedded corpus's held-out documents).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from maxtrain.common.errors import UserError

COMMITTED = Path(__file__).parent / "tasks"
SHOT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]  # a completion example: its one continuation
    gold: int  # index into choices (0 for a completion)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "multiple_choice" or "completion"
    test: tuple[Example, ...]
    train: tuple[Example, ...]

    def prompts(self, shots: int, seed: int) -> list[str]:
        """Each test example's context after `shots` solved train examples, drawn per example
        with a seeded generator (the same prompts for the same seed, wherever they run)."""
        if shots == 0:
            return [e.context for e in self.test]
        pool = self.train
        if len(pool) < shots + 1:
            raise UserError(
                f"task {self.name}: {shots}-shot needs more than {shots} train examples; it has "
                f"{len(pool)}"
            )
        prompts = []
        for index, example in enumerate(self.test):
            rng = random.Random(f"{seed}-{self.name}-{index}")
            solved = [e for e in rng.sample(pool, shots + 1) if e != example][:shots]
            prefix = "".join(e.context + e.choices[e.gold] + SHOT_SEPARATOR for e in solved)
            prompts.append(prefix + example.context)
        return prompts


def committed_tasks() -> list[str]:
    return sorted(p.name for p in COMMITTED.iterdir() if (p / "test.jsonl").is_file())


def load_task(spec: str) -> Task:
    """A committed task by name, a task directory, or one JSONL file; UserError naming the
    file and line of a bad example."""
    path = Path(spec)
    if "/" not in spec and not path.suffix:
        if not (COMMITTED / spec).is_dir():
            raise UserError(
                f"unknown task {spec!r}; committed tasks: {', '.join(committed_tasks())} "
                "(or give a task directory or JSONL file)"
            )
        path = COMMITTED / spec
    if path.is_dir():
        test = _read(path / "test.jsonl")
        train = _read(path / "train.jsonl") if (path / "train.jsonl").is_file() else test
    elif path.is_file():
        test = train = _read(path)
    else:
        raise UserError(f"task {spec}: no such file or directory")
    kind = "multiple_choice" if len(test[0].choices) > 1 else "completion"
    return Task(path.stem if path.is_file() else path.name, kind, tuple(test), tuple(train))


def _read(path: Path) -> list[Example]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read task file {path}: {e}") from None
    examples = [_example(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not examples:
        raise UserError(f"task file {path} holds no examples")
    kinds = {"choices" in line for line in lines if line.strip()}
    if len(kinds) > 1:
        raise UserError(f"task file {path} mixes multiple-choice and completion examples")
    return examples


def _example(line: str, where: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("context"), str):
        raise UserError(f'{where}: expected an object with a "context" string')
    if "choices" in record:
        choices, gold = record["choices"], record.get("gold")
        if not (
            isinstance(choices, list)
            and len(choices) >= 2
            and all(isinstance(c, str) and c for c in choices)
        ):
            raise UserError(f'{where}: "choices" must be a list of at least 2 non-empty strings')
        if not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise UserError(f'{where}: "gold" must be an index into "choices" (got {gold!r})')
        return Example(record["context"], tuple(choices), gold)
    continuation = record.get("continuation")
    if not isinstance(continuation, str) or not continuation:
        raise UserError(f'{where}: expected "choices" and "gold", or a "continuation" string')
    return Example(record["context"], (continuation,), 0)
