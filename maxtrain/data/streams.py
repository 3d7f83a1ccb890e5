"""The train loop's data: this host's batches, and the held-out streams, of whichever kind
`data.kind` names, each built by its own module and picked here once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from maxtrain.config import Config
from maxtrain.data.grain_pipeline import Batch, EvalStream, grain_streams, synthetic_streams
from maxtrain.data.megatron.stream import megatron_streams

STREAMS: dict[str, Callable[[Config, int], tuple[Iterator[Batch], list[EvalStream]]]] = {
    "synthetic": synthetic_streams,
    "grain": grain_streams,
    "megatron": megatron_streams,  # Megatron-LM corpora in Megatron's sample order
}


def data_streams(cfg: Config, start_step: int = 0) -> tuple[Any, list[EvalStream]]:
    """(train iterator of this host's batches from start_step, held-out eval streams).

    For kind grain the train iterator also has get_state()/set_state() for an exact resume.
    """
    return STREAMS[cfg.data.kind](cfg, start_step)
