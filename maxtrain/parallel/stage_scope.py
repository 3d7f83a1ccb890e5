"""The pipeline's stage map (`stage_map`), whether it is tracing one stage's work, and
`per_stage`: a function traced once per stage's share there. Apart from parallel/pipeline.py so
that layers (the MoE's exchange) can ask without importing the pipeline, which imports the
model's stacks."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# True while a stage map traces one stage's work.
IN_STAGE: contextvars.ContextVar[bool] = contextvars.ContextVar("maxtrain_in_stage", default=False)


def stage_map(fn: Callable[..., Any], in_axes: Any = 0) -> Callable[..., Any]:
    """fn over the stages: one computation mapped over its arguments' stage axes (`in_axes`, as
    jax.vmap takes them) and the `stage` mesh axis, traced as one stage's work (IN_STAGE)."""
    mapped = jax.vmap(fn, in_axes=in_axes, spmd_axis_name="stage")

    def call(*args: Any) -> Any:
        token = IN_STAGE.set(True)
        try:
            return mapped(*args)
        finally:
            IN_STAGE.reset(token)

    return call


def per_stage(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, traced inside the stage map (`stage_map`) once for each stage's share, as a program
    of its own rather than batched over the stages; outside the map, fn itself.

    For code whose batched form jax gets wrong: a custom VJP whose forward holds a loop of
    collectives (the MoE exchange's dropless rounds, parallel/expert_exchanges.py `in_rounds`). jax
    batches such a forward lazily, after the map's mesh axis has left its scope, and stops at
    the first operation joining a per-stage value to a constant ("Primitive sub requires
    varying manual axes to match"). Under `per_stage` the map hands fn each device's own slice
    (one stage per device of the `stage` axis), so fn runs as it would without stages: its
    loops take their own stage's trip count, its collectives join only that stage's devices.
    The map unbatches fn before anything differentiates it (custom_vmap has no reverse-mode
    rule), which is why fn is wrapped only while a stage is being traced.
    """
    if not IN_STAGE.get():
        return fn
    mapped = jax.custom_batching.custom_vmap(fn)

    @mapped.def_vmap
    def each_stage(size: int, batched: Any, *args: Any) -> tuple[Any, Any]:
        leaves, tree = jax.tree.flatten(args)
        flags = jax.tree.leaves(batched)

        def stage(i: int) -> Any:
            own = [a[i] if b else a for a, b in zip(leaves, flags, strict=True)]
            return fn(*jax.tree.unflatten(tree, own))

        outs = [stage(i) for i in range(size)]
        return jax.tree.map(lambda *o: jnp.stack(o), *outs), jax.tree.map(lambda _: True, outs[0])

    return mapped
