"""`model.layers`: what each decoder layer is, said once, as one list.

An entry is "ATTENTION-FFN", optionally "*COUNT" for COUNT such layers in a row:

    [global-dense*3, global-moe*58]    DeepSeek-V3: three dense layers, then MoE
    [sliding-dense*5, global-dense]    Gemma 3: five sliding-window layers to one global
    [linear-moe*3, global-moe]         Qwen3-Next: Gated DeltaNet three times, then attention
    [chunked-moe*3, nope-moe]          Llama 4: chunked RoPE layers and a NoPE layer

ATTENTION is what a layer's queries see and how positions reach them: `global` (its whole
document), `sliding` (the last model.sliding_window positions), `chunked` (its chunk of
model.attention_chunk positions), `nope` (global with no position encoding and no qk-norm:
Llama 4's global layers) or `linear` (Gated DeltaNet, model.linear_attention, instead of
softmax attention). FFN is `dense` (a SwiGLU of model.mlp_dim) or `moe` (model.moe).

Layer i is entry i of the expanded list, which repeats over model.num_layers (Gemma 3 27B's 62
layers are ten repetitions of six and two more) or is cut at it (DeepSeek-V3 with 5 of its 61
layers). Absent: every layer global, MoE iff model.moe is set.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

ATTENTION_KINDS = ("global", "sliding", "chunked", "nope", "linear")
FFN_KINDS = ("dense", "moe")
_ENTRY = re.compile(r"(?P<attention>[a-z]+)-(?P<ffn>[a-z]+)(\*(?P<count>\d+))?")
GRAMMAR = (
    f"ATTENTION-FFN or ATTENTION-FFN*COUNT, ATTENTION one of {', '.join(ATTENTION_KINDS)}, "
    f"FFN {' or '.join(FFN_KINDS)}, COUNT >= 1"
)


class LayerType(NamedTuple):
    """One decoder layer: its attention kind and its feed-forward kind."""

    attention: str
    ffn: str

    def __str__(self) -> str:
        return f"{self.attention}-{self.ffn}"


def parse_entry(text: str) -> tuple[LayerType, int]:
    """'global-moe*58' -> (LayerType('global', 'moe'), 58); ValueError("must be ...") for
    anything else (the config names the key it came from)."""
    found = _ENTRY.fullmatch(text.replace(" ", "")) if isinstance(text, str) else None
    if (
        found is None
        or found["attention"] not in ATTENTION_KINDS
        or found["ffn"] not in FFN_KINDS
        or (found["count"] is not None and int(found["count"]) < 1)
    ):
        raise ValueError(f"must be {GRAMMAR}")
    count = 1 if found["count"] is None else int(found["count"])
    return LayerType(found["attention"], found["ffn"]), count


def checked_entry(text: str) -> str:
    """A pydantic validator: the entry as written, once it parses."""
    parse_entry(text)
    return text


def layer_types(entries: Sequence[str] | None, num_layers: int, moe: bool) -> tuple[LayerType, ...]:
    """Per model layer, its type: the expanded entries, repeated over (or cut at) num_layers;
    without entries every layer global, MoE iff the model has `moe`."""
    if entries is None:
        return (LayerType("global", "moe" if moe else "dense"),) * num_layers
    cycle: list[LayerType] = []
    for entry in entries:
        kind, count = parse_entry(entry)
        cycle += [kind] * count
    return tuple(cycle[i % len(cycle)] for i in range(num_layers))


def shortest_entries(types: Sequence[LayerType], moe: bool) -> list[str] | None:
    """The shortest model.layers that gives `types` (a partial last repetition allowed), runs
    of one type written "TYPE*COUNT"; None where that is the default (every layer global, MoE
    iff `moe`). What the Hugging Face importer and the migration of old keys write."""
    if types == layer_types(None, len(types), moe):
        return None
    period = next(
        p
        for p in range(1, len(types) + 1)
        if all(kind == types[i % p] for i, kind in enumerate(types))
    )
    runs: list[tuple[LayerType, int]] = []
    for kind in types[:period]:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + 1)
        else:
            runs.append((kind, 1))
    return [str(kind) if count == 1 else f"{kind}*{count}" for kind, count in runs]
