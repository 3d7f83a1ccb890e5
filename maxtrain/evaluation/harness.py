"""Accuracies of tasks from continuation log-likelihoods, as lm-evaluation-harness defines them.

Multiple choice: `acc` is the share of examples whose gold choice has the highest
log-likelihood after the context; `acc_norm` divides each choice's log-likelihood by its
length in UTF-8 bytes first (long choices are not penalised for their length). Completion:
`acc` is the share whose continuation greedy decoding would produce, `loglik` the mean
log-likelihood of the continuation.

A continuation's ids are those of context + continuation after the context's own ids (the
harness's rule: a tokenizer may merge across the boundary). The context starts as the model's
documents do: after the tokenizer's special tokens for a Hugging Face model (its BOS), after an
EOS for a model trained on maxtrain's prepared data (documents are EOS-delimited).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh

from maxtrain.common.errors import UserError
from maxtrain.config import Config, ConfigError
from maxtrain.evaluation.scoring import Request, Scorer
from maxtrain.evaluation.tasks import Task, load_task
from maxtrain.inference.loading import data_tokenizer_path
from maxtrain.models import ModelDef
from maxtrain.tokenizers import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class _Prepared:
    task: Task
    requests: list[Request]  # per example, one per choice, in order
    byte_lengths: np.ndarray  # [examples, choices] UTF-8 bytes of each choice
    gold: np.ndarray  # [examples]


class TaskEvaluator:
    """Tokenizes the tasks' prompts once; each call scores a set of parameters."""

    def __init__(
        self,
        tasks: Sequence[Task],
        tokenizer: Tokenizer,
        scorer: Scorer,
        *,
        shots: int = 0,
        seed: int = 0,
        special_tokens: bool = False,
    ):
        self.scorer = scorer
        self.prepared = [_prepare(task, tokenizer, shots, seed, special_tokens) for task in tasks]

    def __call__(self, params: Any, progress: bool = False) -> dict[str, float]:
        """{"<task>/acc": ..., "<task>/acc_norm" | "<task>/loglik": ...} for every task.
        progress: a progress bar per task on a terminal (the command-line tool's)."""
        metrics = {}
        for p in self.prepared:
            logprob, greedy = self.scorer(params, p.requests, p.task.name if progress else None)
            name = p.task.name
            if p.task.kind == "completion":
                metrics[f"{name}/acc"] = float(greedy.mean())
                metrics[f"{name}/loglik"] = float(logprob.mean())
                continue
            scores = logprob.reshape(p.byte_lengths.shape)
            metrics[f"{name}/acc"] = float((scores.argmax(1) == p.gold).mean())
            normalized = scores / p.byte_lengths
            metrics[f"{name}/acc_norm"] = float((normalized.argmax(1) == p.gold).mean())
        return metrics


def chance(task: Task) -> float:
    """The expected accuracy of a model that knows nothing (uniform over the choices)."""
    if task.kind == "completion":
        return 0.0
    return float(np.mean([1 / len(e.choices) for e in task.test]))


def _prepare(
    task: Task, tokenizer: Tokenizer, shots: int, seed: int, special_tokens: bool
) -> _Prepared:
    if task.kind == "multiple_choice" and len({len(e.choices) for e in task.test}) > 1:
        raise UserError(f"task {task.name}: every example needs the same number of choices")
    prompts = task.prompts(shots, seed)
    pairs = [
        (prompt, choice)
        for prompt, e in zip(prompts, task.test, strict=True)
        for choice in e.choices
    ]
    contexts = _encode(tokenizer, prompts, special_tokens)
    wholes = _encode(tokenizer, [prompt + choice for prompt, choice in pairs], special_tokens)
    per_example = len(task.test[0].choices)
    requests = []
    for i, whole in enumerate(wholes):
        context = contexts[i // per_example]
        split = len(context) if whole[: len(context)] == context else _common_prefix(context, whole)
        split = min(split, len(whole) - 1)  # at least one continuation token
        requests.append((whole[:split], whole[split:]))
    lengths = np.array([[len(c.encode()) for c in e.choices] for e in task.test], np.float64)
    gold = np.array([e.gold for e in task.test])
    return _Prepared(task, requests, np.maximum(lengths, 1.0), gold)


def _encode(tokenizer: Tokenizer, texts: list[str], special_tokens: bool) -> list[list[int]]:
    if special_tokens:
        return tokenizer.encode(texts, add_special_tokens=True)
    return [[tokenizer.eos_id, *ids] for ids in tokenizer.encode(texts)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def task_evaluator(
    cfg: Config,
    mdef: ModelDef,
    mesh: Mesh,
    task_specs: Sequence[str],
    *,
    shots: int,
    tokenizer: Tokenizer | None = None,
    special_tokens: bool = False,
) -> TaskEvaluator:
    """The evaluator of `task_specs` (tasks.load_task) for a run's model, in batches of its
    micro-batch shape; the tokenizer is the run's data's unless given. Its n-shot examples are
    drawn with run.seed. Used by the train loop (train.eval_tasks) and maxtrain.evaluate alike,
    so both score the same requests the same way."""
    if tokenizer is None:
        path = data_tokenizer_path(cfg)
        if path is None:
            raise ConfigError(
                f"train.eval_tasks needs a tokenizer, and data.kind={cfg.data.kind} has none; "
                "evaluate tasks with a tokenized corpus (data.kind grain)"
            )
        tokenizer = load_tokenizer(path)
    tasks = [load_task(spec) for spec in task_specs]
    scorer = Scorer(mdef, mesh, cfg.mesh.rules, cfg.micro_batch_size, cfg.train.seq_len)
    return TaskEvaluator(
        tasks, tokenizer, scorer, shots=shots, seed=cfg.run.seed, special_tokens=special_tokens
    )
