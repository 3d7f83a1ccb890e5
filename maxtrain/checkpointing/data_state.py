"""How the data iterator's position is saved beside the train state (the `data` item).

An adapter says whether it handles an iterator and builds the Orbax save/restore arguments for
it. The first adapter that matches wins; add one to DATA_STATE_ADAPTERS for a new kind.

- grain iterators go through grain's own Orbax handler: one `process_<i>-of-<n>.json` per
  process, so every host restores its own shard position.
- anything else with `get_state()`/`set_state()` is saved as the JSON of `get_state()`, written
  by the primary process (single-process runs only; use a grain iterator on several hosts).
- an iterator without state (a generator) saves nothing; the train loop then has to replay or
  recompute its position from the step (the synthetic stream does that from start_step).
"""

from __future__ import annotations

from typing import Any, Protocol

import grain
import orbax.checkpoint as ocp


class DataStateAdapter(Protocol):
    def matches(self, iterator: Any) -> bool: ...
    def save_args(self, iterator: Any) -> ocp.args.CheckpointArgs: ...
    def restore_args(self, iterator: Any) -> ocp.args.CheckpointArgs: ...
    def apply(self, iterator: Any, restored: Any) -> None: ...


class GrainIteratorState:
    def matches(self, iterator: Any) -> bool:
        return isinstance(iterator, grain.DatasetIterator | grain.DataLoaderIterator)

    def save_args(self, iterator: Any) -> ocp.args.CheckpointArgs:
        return grain.checkpoint.CheckpointSave(iterator)

    def restore_args(self, iterator: Any) -> ocp.args.CheckpointArgs:
        return grain.checkpoint.CheckpointRestore(iterator)

    def apply(self, iterator: Any, restored: Any) -> None:
        del iterator, restored  # grain's handler already called set_state()


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


DATA_STATE_ADAPTERS: list[DataStateAdapter] = [GrainIteratorState(), JsonIteratorState()]


def adapter_for(iterator: Any) -> DataStateAdapter | None:
    """The adapter that saves this iterator's position, or None (nothing to save)."""
    if iterator is None:
        return None
    return next((a for a in DATA_STATE_ADAPTERS if a.matches(iterator)), None)
