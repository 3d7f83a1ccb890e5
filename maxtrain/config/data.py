"""The `data:` section: the sources of a mixture (or a Megatron blend), packing and loaders."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from maxtrain.config.domains import NonNegativeFloat, Section


class DataSource(Section):
    """One prepared corpus in the mixture (a directory or glob of tokenized shards), or with
    data.kind megatron one Megatron corpus (the prefix of PREFIX.bin / PREFIX.idx)."""

    # Names key the held-out split and the eval metrics (eval/<name>/loss): keep them stable.
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)  # shard directory, glob, embedded:<prose|code|math>, prefix
    # tokens: prepared shards; chat / preference: a JSONL file of conversations / preference
    # pairs, rendered with data.chat_template and tokenized on load (maxtrain/data/chat.py);
    # prompts: a JSONL file of {"prompt", "completion"} whose completion is the reference answer
    # a reward checks (train.task grpo: maxtrain/data/prompts.py)
    format: Literal["tokens", "chat", "preference", "prompts"] = "tokens"
    # grain: share of TOKENS, 0 = eval only; megatron: Megatron's blend weight (share of SAMPLES)
    weight: NonNegativeFloat = 1.0


# `sources: embedded` expands to this: the corpus built offline on first use
# (data/corpora/embedded.py).
EMBEDDED_SOURCES = (
    {"name": "prose", "path": "embedded:prose", "weight": 0.5},
    {"name": "code", "path": "embedded:code", "weight": 0.3},
    {"name": "math", "path": "embedded:math", "weight": 0.2},
)


# Megatron's split string: up to three non-negative numbers (train, valid, test), as it parses it.
_MEGATRON_SPLIT = r"\s*[0-9]*\.?[0-9]+\s*(,\s*[0-9]*\.?[0-9]+\s*){0,2}"


class MegatronConfig(Section):
    """data.kind megatron: Megatron-LM corpora sampled as Megatron's GPTDataset/BlendedDataset
    do (maxtrain/data/megatron/); each key is the Megatron flag of the same name."""

    split: str = "969,30,1"  # --split: train,valid,test shares of each corpus's sequences
    # The end-of-document token id (Megatron's tokenizer.eod); needed by the three switches.
    eod_id: int | None = Field(default=None, ge=0)
    reset_position_ids: bool = False  # positions restart after every EOD
    reset_attention_mask: bool = False  # attention does not cross an EOD
    eod_mask_loss: bool = False  # no loss where the input token is an EOD

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        if not re.fullmatch(_MEGATRON_SPLIT, self.split):
            raise ValueError(
                f"data.megatron.split {self.split!r} is not a Megatron --split: up to three "
                "non-negative numbers (train, valid, test), e.g. 969,30,1"
            )
        if sum(float(x) for x in re.findall(r"[.0-9]+", self.split)) <= 0:
            raise ValueError(f"data.megatron.split {self.split!r} gives every split 0")
        switches = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
        on = [name for name in switches if getattr(self, name)]
        if on and self.eod_id is None:
            raise ValueError(
                f"data.megatron.{on[0]} needs data.megatron.eod_id, the end-of-document token id"
            )
        return self


class DataConfig(Section):
    """What the run reads: synthetic text, a weighted mixture of sources, or Megatron corpora."""

    kind: Literal["synthetic", "grain", "megatron"] = "grain"
    # Synthetic text: each token has this many likely successors, so the loss floor is ~log(it).
    synthetic_branching: int = Field(default=4, gt=0)
    # grain: the weighted mixture of prepared sources; the string "embedded" = EMBEDDED_SOURCES.
    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource(**s) for s in EMBEDDED_SOURCES]
    )
    # the embedded corpus and Megatron index files; None: $MAXTRAIN_CACHE or ~/.cache/maxtrain
    cache_dir: str | None = None
    # chat and preference sources: a built-in template (chatml, plain), a .jinja file, or a
    # tokenizer_config.json (or its directory) holding a chat_template
    chat_template: str = Field(default="chatml", min_length=1)
    # chat and preference sources; None: the committed default
    tokenizer: str | None = Field(default=None, min_length=1)
    packing: Literal["concat_then_split", "first_fit"] = "concat_then_split"
    first_fit_bins: int = Field(default=8, gt=0)  # first_fit: open rows per stream (less padding)
    eval_fraction: float = Field(
        default=0.05, ge=0, lt=1, allow_inf_nan=False
    )  # held-out documents per source
    shuffle_seed: int | None = Field(default=None, ge=0)  # None: run.seed
    num_workers: int = Field(default=0, ge=0)  # 0: read in-process; >0: grain worker processes
    worker_buffer_size: int = Field(default=2, ge=0)  # batches buffered per worker (or thread)
    megatron: MegatronConfig = MegatronConfig()

    @model_validator(mode="before")
    @classmethod
    def _expand_embedded(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("sources") == "embedded":
            return {**data, "sources": [dict(s) for s in EMBEDDED_SOURCES]}
        return data

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        if not self.sources:
            raise ValueError(
                "data.sources is empty; list at least one {name, path, weight} or set "
                "data.sources: embedded"
            )
        names = [s.name for s in self.sources]
        for name in names:
            if not all(c.isalnum() or c in "_.-" for c in name):
                raise ValueError(
                    f"data.sources: name {name!r} may hold only letters, digits, '_', '.' and '-'"
                )
            if names.count(name) > 1:
                raise ValueError(f"data.sources: duplicate source name {name!r}")
        for s in self.sources:
            if s.format != "tokens" and self.kind != "grain":
                raise ValueError(f"data.sources[{s.name}].format={s.format} needs data.kind grain")
            if s.weight == 0 and self.kind == "megatron":
                raise ValueError(
                    f"data.sources[{s.name}].weight is 0; Megatron's blend takes positive "
                    "weights only"
                )
        if sum(s.weight for s in self.sources) <= 0:
            raise ValueError(
                "data.sources: the weights sum to 0; give at least one source a positive weight"
            )
        return self
