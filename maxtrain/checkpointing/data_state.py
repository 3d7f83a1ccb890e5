"""How the data iterator's position is saved beside the train state (the `data` item).

An adapter says whether it handles an iterator and builds the Orbax save/restore arguments for
it. The first adapter that matches wins; add one to DATA_STATE_ADAPTERS for a new kind.

- grain iterators go through grain's own Orbax handler: one `process_<i>-of-<n>.json` per
  process, so every host restores its own shard position.
- anything else with `get_state()`/`set_state()` is saved as the JSON of `get_state()`, written
  by the primary process and read by every process: for states that are the same on every host,
  such as the Megatron reader's next step (data/megatron/stream.py), which therefore restores on
  any number of hosts. A state that differs per host needs a grain iterator instead.
- an iterator without state (a generator) saves nothing; the train loop then has to replay or
  recompute its position from the step (the synthetic stream does that from start_step).

`to_json`/`from_json` give the same state as text, for the emergency checkpointer, which writes
one JSON file per process itself (Orbax's emergency manager saves only the train state).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import grain
import orbax.checkpoint as ocp


class DataStateAdapter(Protocol):
    def matches(self, iterator: Any) -> bool: ...
    def save_args(self, iterator: Any) -> ocp.args.CheckpointArgs: ...
    def restore_args(self, iterator: Any) -> ocp.args.CheckpointArgs: ...
    def apply(self, iterator: Any, restored: Any) -> None: ...
    def to_json(self, iterator: Any) -> str: ...
    def from_json(self, iterator: Any, text: str) -> None: ...


class GrainIteratorState:
    def matches(self, iterator: Any) -> bool:
        return isinstance(iterator, grain.DatasetIterator | grain.DataLoaderIterator)

    def save_args(self, iterator: Any) -> ocp.args.CheckpointArgs:
        return grain.checkpoint.CheckpointSave(iterator)

    def restore_args(self, iterator: Any) -> ocp.args.CheckpointArgs:
        return grain.checkpoint.CheckpointRestore(iterator)

    def apply(self, iterator: Any, restored: Any) -> None:
        del iterator, restored  # grain's handler already called set_state()

    # The text grain's own handler writes and reads (grain/_src/python/checkpoint/handler.py).
    def to_json(self, iterator: Any) -> str:
        if isinstance(iterator, grain.DatasetIterator):
            return json.dumps(iterator.get_state(), indent=1)
        return iterator.get_state().decode()

    def from_json(self, iterator: Any, text: str) -> None:
        dataset = isinstance(iterator, grain.DatasetIterator)
        iterator.set_state(json.loads(text) if dataset else text.encode())
        iterator.start_prefetch()


class JsonIteratorState:
    def matches(self, iterator: Any) -> bool:
        return callable(getattr(iterator, "get_state", None)) and callable(
            getattr(iterator, "set_state", None)
        )

    def save_args(self, iterator: Any) -> ocp.args.CheckpointArgs:
        return ocp.args.JsonSave({"state": iterator.get_state()})

    def restore_args(self, iterator: Any) -> ocp.args.CheckpointArgs:
        del iterator
        return ocp.args.JsonRestore()

    def apply(self, iterator: Any, restored: Any) -> None:
        iterator.set_state(restored["state"])

    def to_json(self, iterator: Any) -> str:
        return json.dumps({"state": iterator.get_state()})

    def from_json(self, iterator: Any, text: str) -> None:
        iterator.set_state(json.loads(text)["state"])


DATA_STATE_ADAPTERS: list[DataStateAdapter] = [GrainIteratorState(), JsonIteratorState()]


def adapter_for(iterator: Any) -> DataStateAdapter | None:
    """The adapter that saves this iterator's position, or None (nothing to save)."""
    if iterator is None:
        return None
    return next((a for a in DATA_STATE_ADAPTERS if a.matches(iterator)), None)
