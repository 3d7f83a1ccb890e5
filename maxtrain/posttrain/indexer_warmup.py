"""DeepSeek sparse attention's dense warm-up (model.mla.indexer.stage warmup): the indexers
train, everything else is held frozen, read from checkpoint.load_parameters_path.

DeepSeek-V3.2 (sec. 2.1.1) starts from a dense model: its attention stays dense and only the
new lightning indexers learn, by their KL loss (models/indexer_training.py), what the attention
attends to. That checkpoint is the frozen part here: it holds every parameter but the indexers
(a dense MLA model of the same shape), and the indexers start from the model's initialisation.
The run's checkpoints hold the indexers alone; the sparse stage starts from both (docs/deepseek.md).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from maxtrain.config import Config

# The key of an attention layer's indexer in the parameter tree (layers/mla.py).
INDEXER = "indexer"


def split_indexers(params: dict) -> tuple[dict, dict]:
    """A params dict -> (the indexers' subtrees, everything else), each nested like it."""
    trained, frozen = {}, {}
    for key, value in params.items():
        if key == INDEXER:
            trained[key] = value
        elif isinstance(value, dict):
            inner_trained, inner_frozen = split_indexers(value)
            if inner_trained:
                trained[key] = inner_trained
            if inner_frozen:
                frozen[key] = inner_frozen
        else:
            frozen[key] = value
    return trained, frozen


def merged(a: dict, b: dict) -> dict:
    """The union of two nested dicts with disjoint leaves (split_indexers' inverse)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = merged(out[key], value) if key in out else value
    return out


class IndexerWarmup:
    """training/split.py's ParameterSplit: the indexers train, the rest is frozen."""

    adds_parameters = False
    loads_trained = False
    has_frozen = True

    def adapt(self, module: nnx.Module, seed: int) -> None:
        del module, seed

    def wrap(self, module: nnx.Module) -> nnx.Module:
        return module

    def split(self, params: dict) -> tuple[dict, dict]:
        return split_indexers(params)

    def combine(self, trained: dict, frozen: Any) -> dict:
        return merged(frozen, trained)

    def stored(self, frozen: dict, abstract_state: nnx.State) -> dict:
        del abstract_state
        return frozen

    def start(self, trained: dict, frozen: Any) -> None:
        del trained, frozen
        return None

    def describe(self, cfg: Config) -> str:
        return f"the indexers trained (warm-up; the rest {cfg.checkpoint.load_parameters_path}), "
