"""Prompts for reinforcement learning (train.task grpo): a JSONL file of
{"prompt": str, "completion": str}, the completion the reference answer a reward checks.

A prompt is plain text, tokenized as pre-training documents begin: after an EOS (maxtrain's
prepared documents are EOS-delimited, so the model has seen text start there; the evaluation
harness scores tasks the same way). The held-out split is the pipeline's hash of (source name,
line index) below data.eval_fraction (grain_pipeline.held_out): fixed for a given file and
independent of seeds. The training prompts are drawn in a shuffled order per epoch, seeded by
(shuffle seed, epoch), so the iterator's whole state is how many prompts it has handed out:
`get_state`/`set_state` resume it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maxtrain.config import Config
from maxtrain.data import chat
from maxtrain.data.errors import DataError
from maxtrain.data.grain_pipeline import derive_seed, held_out
from maxtrain.tokenizers import Tokenizer


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]  # EOS, then the prompt's tokens
    answer: str  # the reference completion
    text: str


def read_prompts(path: str, tokenizer: Tokenizer) -> list[Prompt]:
    """Every line's prompt, tokenized; DataError naming the file and line of a bad one."""
    prompts = []
    for where, row in chat.read_jsonl(path):
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise DataError(f"{where}: expected string fields 'prompt' and 'completion'")
        ids = tokenizer.encode([row["prompt"]])[0]
        prompts.append(Prompt((tokenizer.eos_id, *ids), row["completion"], row["prompt"]))
    return prompts


class PromptStream:
    """The training prompts, `per_step` at a time, each epoch in its own shuffled order; the
    held-out ones in file order (`held_out`)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer):
        source = cfg.data.sources[0]
        try:
            prompts = read_prompts(source.path, tokenizer)
        except DataError as e:
            raise DataError(f"data.sources[{source.name}]: {e}") from None
        out = held_out(source.name, len(prompts), cfg.data.eval_fraction)
        self.train = [p for p, o in zip(prompts, out, strict=True) if not o]
        self.held_out = [p for p, o in zip(prompts, out, strict=True) if o]
        if not self.train:
            raise DataError(f"data.sources[{source.name}]: every prompt is held out")
        if cfg.train.eval_every and not self.held_out:
            raise DataError(
                f"data.sources[{source.name}]: no prompt is held out for evaluation "
                f"(data.eval_fraction={cfg.data.eval_fraction}); raise it or set "
                "train.eval_every=0"
            )
        self.per_step = cfg.train.global_batch_size // cfg.train.grpo.group_size
        self.seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.run.seed
        self.position = 0  # prompts handed out so far

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(derive_seed(self.seed, "prompts", epoch)).permutation(
            len(self.train)
        )

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> list[Prompt]:
        n = len(self.train)
        picked = []
        for i in range(self.position, self.position + self.per_step):
            picked.append(self.train[int(self._order(i // n)[i % n])])
        self.position += self.per_step
        return picked

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])
