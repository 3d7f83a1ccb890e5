"""The layouts a plan considers, and the rules that drop those that cannot work.

A candidate is one way to run the config's model and global batch on the chips: each mesh
axis's degree within a slice and across slices (DCN), the remat policy, the micro-batches per
step (train.grad_accum_steps), and where they apply the pipeline's micro-batches, the expert
exchange and the context exchange. `enumerate_candidates` crosses every factorisation of the
chips over the axes the model can use with those choices; `rule_out` says why one cannot run
(or is dominated by another the plan keeps), before anything is estimated or compiled.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from maxtrain.config import MESH_AXES, Config
from maxtrain.parallel.expert_exchanges import ragged_supported
from maxtrain.parallel.mesh import axis_sizes

REMAT_POLICIES = ("none", "minimal", "full")
EXPERT_EXCHANGES = ("ragged", "all_to_all", "all_gather")
CONTEXT_EXCHANGES = ("all_gather", "ring")
# Axes whose collectives run in every layer: never across the data-center network.
DCN_AXES = ("data", "fsdp", "stage")
MAX_ACCUM = 8  # micro-batches per step the search tries, in powers of two


@dataclass(frozen=True)
class Candidate:
    """One layout: what `overrides` sets on top of the config."""

    ici: tuple[int, ...]  # degree per MESH_AXES axis within a slice
    dcn: tuple[int, ...]  # degree per MESH_AXES axis across slices
    remat: str
    grad_accum: int
    pipeline_microbatches: int | None = None  # with stages only
    expert_exchange: str | None = None  # with mesh.expert > 1 only
    context_exchange: str | None = None  # with mesh.context > 1 only

    def degree(self, axis: str) -> int:
        i = MESH_AXES.index(axis)
        return self.ici[i] * self.dcn[i]

    def overlay(self) -> dict:
        """The config keys this layout sets, as a YAML overlay's tree."""
        mesh = dict(zip(MESH_AXES, self.ici, strict=True))
        mesh["num_slices"] = math.prod(self.dcn)
        mesh["dcn"] = dict(zip(MESH_AXES, self.dcn, strict=True))
        tree = {
            "mesh": mesh,
            "compute": {"remat": self.remat},
            "train": {"grad_accum_steps": self.grad_accum},
        }
        if self.expert_exchange:
            tree["compute"]["expert_exchange"] = self.expert_exchange
        if self.context_exchange:
            tree["compute"]["context_exchange"] = self.context_exchange
        if self.pipeline_microbatches:
            tree["pipeline"] = {"microbatches": self.pipeline_microbatches}
        return tree

    def overrides(self) -> list[str]:
        """The overlay as key=value overrides (what a plan's compile is handed)."""
        return [f"{key}={value}" for key, value in _flatten(self.overlay())]

    def label(self) -> str:
        """ "fsdp 8 x tensor 2, dcn data 2 | remat full | 2 micro-batches" and so on."""
        ici = " x ".join(f"{a} {d}" for a, d in zip(MESH_AXES, self.ici, strict=True) if d > 1)
        dcn = " x ".join(f"{a} {d}" for a, d in zip(MESH_AXES, self.dcn, strict=True) if d > 1)
        parts = [(ici or "one chip") + (f", dcn {dcn}" if dcn else "")]
        parts += [f"remat {self.remat}", f"accum {self.grad_accum}"]
        if self.pipeline_microbatches:
            parts.append(f"pipeline M {self.pipeline_microbatches}")
        if self.expert_exchange:
            parts.append(self.expert_exchange)
        if self.context_exchange:
            parts.append(f"context {self.context_exchange}")
        return " | ".join(parts)


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config_candidate(cfg: Config, chips_per_slice: int) -> Candidate:
    """The layout the config itself states (its -1 resolved): the baseline a plan beats."""
    sizes = axis_sizes(cfg.mesh, chips_per_slice * cfg.mesh.num_slices)
    dcn = tuple(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
    ici = tuple(sizes[a] // d for a, d in zip(MESH_AXES, dcn, strict=True))
    stages = sizes["stage"] > 1
    return Candidate(
        ici=ici,
        dcn=dcn,
        remat=cfg.compute.remat,
        grad_accum=cfg.train.grad_accum_steps,
        pipeline_microbatches=(cfg.pipeline.microbatches or sizes["stage"]) if stages else None,
        expert_exchange=cfg.compute.expert_exchange if sizes["expert"] > 1 else None,
        context_exchange=cfg.compute.context_exchange if sizes["context"] > 1 else None,
    )


def usable_axes(cfg: Config) -> tuple[str, ...]:
    """The mesh axes this model can split over: expert only for an MoE."""
    return tuple(a for a in MESH_AXES if a != "expert" or cfg.model.moe is not None)


def factorisations(n: int, slots: int) -> Iterator[tuple[int, ...]]:
    """Every ordered way to write n as a product of `slots` positive integers."""
    if slots == 1:
        yield (n,)
        return
    for first in (d for d in range(1, n + 1) if n % d == 0):
        for rest in factorisations(n // first, slots - 1):
            yield (first, *rest)


def _spread(degrees: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:
    """Degrees over `axes` as a full MESH_AXES tuple (1 for the others)."""
    named = dict(zip(axes, degrees, strict=True))
    return tuple(named.get(a, 1) for a in MESH_AXES)


def enumerate_candidates(cfg: Config, chips_per_slice: int, slices: int) -> Iterator[Candidate]:
    """Every layout of the search: factorisations of a slice's chips over the usable axes and
    of the slices over the DCN axes, crossed with remat policies, micro-batch counts (powers of
    two up to MAX_ACCUM that divide the global batch) and, where they apply, the pipeline's
    micro-batches (S and 2S), the expert exchange and the context exchange."""
    axes = usable_axes(cfg)
    batch = cfg.train.global_batch_size
    accums = [a for a in (2**i for i in range(MAX_ACCUM.bit_length())) if batch % a == 0]
    dcn_axes = tuple(a for a in DCN_AXES if a in axes)
    for ici_degrees in factorisations(chips_per_slice, len(axes)):
        ici = _spread(ici_degrees, axes)
        for dcn_degrees in factorisations(slices, len(dcn_axes)):
            dcn = _spread(dcn_degrees, dcn_axes)
            yield from _choices(ici, dcn, accums)


def _choices(ici: tuple[int, ...], dcn: tuple[int, ...], accums: list[int]) -> Iterator[Candidate]:
    degree = {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn, strict=True)}
    stages = degree["stage"]
    pipeline = (stages, 2 * stages) if stages > 1 else (None,)
    experts = EXPERT_EXCHANGES if degree["expert"] > 1 else (None,)
    contexts = CONTEXT_EXCHANGES if degree["context"] > 1 else (None,)
    for remat, accum, m, expert, context in itertools.product(
        REMAT_POLICIES, accums, pipeline, experts, contexts
    ):
        yield Candidate(ici, dcn, remat, accum, m, expert, context)


def rule_out(cfg: Config, c: Candidate, device_kind: str, chips_per_slice: int) -> str | None:
    """Why a candidate cannot run on a slice of `chips_per_slice` chips of `device_kind`, or is
    dominated by one the plan keeps; None if it may."""
    model, moe = cfg.model, cfg.model.moe
    micro = cfg.train.global_batch_size // c.grad_accum
    batch_ways = math.prod(c.degree(a) for a in cfg.mesh.rules.get("batch", []))
    tensor, context, stages = c.degree("tensor"), c.degree("context"), c.degree("stage")
    if micro % batch_ways:
        return "micro-batch not divisible by the batch axes"
    if model.num_heads % tensor or model.resolved_kv_heads % tensor:
        return "heads not divisible by tensor"
    if model.mlp_dim and model.mlp_dim % tensor:
        return "mlp width not divisible by tensor"
    if moe is not None and moe.num_experts % c.degree("expert"):
        return "experts not divisible by expert"
    if c.expert_exchange == "ragged" and not ragged_supported(device_kind, chips_per_slice):
        return "ragged exchange does not compile on this slice"
    if cfg.train.seq_len % (2 * context):
        return "sequence not divisible into 2 x context blocks"
    if context > 1 and micro % (batch_ways * context) == 0:
        # the same chips could split the batch instead: the same activations per chip,
        # without exchanging keys and values in every layer
        return "context where the batch could split (dominated)"
    if stages > 1:
        repeats = cfg.pipeline.repeats
        if model.num_layers % (stages * repeats):
            return "layers not divisible by the stages"
        m = c.pipeline_microbatches
        if micro % m or (micro // m) % batch_ways:
            return "micro-batch not divisible into pipeline micro-batches"
    return None
