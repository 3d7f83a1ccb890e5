"""The train loop's data: this host's batches, and the held-out streams, of whichever kind
`data.kind` names, each built by its own module and picked here once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from maxtrain.config import Config
from maxtrain.data import chat
from maxtrain.data.grain_pipeline import Batch, EvalStream, grain_streams, synthetic_streams
from maxtrain.data.megatron.stream import megatron_streams
from maxtrain.data.prompts import PromptStream
from maxtrain.data.shards import check_vocab

STREAMS: dict[str, Callable[[Config, int], tuple[Iterator[Batch], list[EvalStream]]]] = {
    "synthetic": synthetic_streams,
    "grain": grain_streams,
    "megatron": megatron_streams,  # Megatron-LM corpora in Megatron's sample order
}


def data_streams(cfg: Config, start_step: int = 0) -> tuple[Any, list[EvalStream]]:
    """(train iterator of this host's batches from start_step, held-out eval streams).

    For kind grain the train iterator also has get_state()/set_state() for an exact resume.
    train.task grpo reads prompts (data/prompts.py), no held-out batches: its rollouts sample
    completions of them (maxtrain/posttrain/rollout.py) and score held-out prompts themselves.
    """
    if cfg.train.task == "grpo":
        tokenizer = chat.load_tokenizer(cfg.data.tokenizer)
        check_vocab({"tokenizer": tokenizer.path, "vocab_size": tokenizer.vocab_size},
                    cfg.model.vocab_size)  # fmt: skip
        prompts = PromptStream(cfg, tokenizer)
        for _ in range(start_step):
            next(prompts)
        return prompts, []
    return STREAMS[cfg.data.kind](cfg, start_step)
