"""Verifiable rewards: functions of (prompt, completion, reference answer) -> float, weighted
and summed as train.grpo.rewards names them.

Built-ins, for answers like the committed arithmetic problems' (" 15."):
  exact   1 when the completion, up to its first newline and without surrounding whitespace,
          is the reference answer so stripped; else 0
  format  1 when the completion is an answer's shape, a whole number and a period; else 0
A user's reward is `module:function` (the module importable from the working directory or
PYTHONPATH), called as function(prompt=..., completion=..., answer=...).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence

import numpy as np

from maxtrain.common.errors import UserError

type Reward = Callable[..., float]
_ANSWER_SHAPE = re.compile(r"\s*-?\d+\.\s*")


def exact(prompt: str, completion: str, answer: str) -> float:
    del prompt
    return float(completion.split("\n", 1)[0].strip() == answer.strip())


def answer_format(prompt: str, completion: str, answer: str) -> float:
    del prompt, answer
    return float(_ANSWER_SHAPE.fullmatch(completion.split("\n", 1)[0]) is not None)


BUILTIN: dict[str, Reward] = {"exact": exact, "format": answer_format}


def resolve(name: str) -> Reward:
    """A built-in's function, or the `module:function` a user named; UserError naming what is
    missing."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, _, function = name.partition(":")
    if not function:
        raise UserError(
            f"train.grpo.rewards: {name!r} is neither a built-in ({', '.join(BUILTIN)}) nor "
            "module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"train.grpo.rewards: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise UserError(f"train.grpo.rewards: {module_name} has no function {function!r}")
    return fn


class Rewards:
    """The configured rewards, each resolved once: scores a batch of completions."""

    def __init__(self, weights: dict[str, float]):
        self.named = [(name, resolve(name), weight) for name, weight in weights.items()]

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
    ) -> tuple[np.ndarray, dict[str, float], np.ndarray]:
        """([N] weighted total per completion, {reward name: its mean over the batch}, [N] the
        first reward's scores: what accuracy counts)."""
        total = np.zeros(len(completions), np.float64)
        means, first = {}, None
        for name, fn, weight in self.named:
            scores = np.array(
                [
                    float(fn(prompt=p, completion=c, answer=a))
                    for p, c, a in zip(prompts, completions, answers, strict=True)
                ]
            )
            total += weight * scores
            means[name] = float(scores.mean())
            first = scores if first is None else first
        return total.astype(np.float32), means, first
