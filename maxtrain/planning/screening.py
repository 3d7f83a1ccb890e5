"""The plan's second sieve and its order, from the config alone: each candidate that passed the
rules (candidates.py) is estimated (analysis/memory.py); what cannot fit even with the
estimate's measured error as margin is dropped, and so is a candidate with more micro-batches
than its memory needs (the same layout with fewer fits, and fewer micro-batches mean fewer
weight gathers). The survivors are ordered by a first-order step time, those the estimate says
fit without the margin first, so that a plan whose time budget runs out has compiled the
likeliest first.

The first-order time is the larger of the model's FLOPs (remat's recomputation included) at
the chip's bf16 peak and the weight collectives over the chip's links (FSDP's gathers and
reduce-scatters, once per micro-batch; data parallelism's all-reduce), plus the tensor
parallel all-reduces of activations and the context exchange's keys and values in every
layer, divided by the pipeline's busy share. It
only orders the compiles; the ranking is the compiled program's prediction.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from maxtrain import models as model_lib
from maxtrain.analysis import memory
from maxtrain.analysis.preflight import MARGIN
from maxtrain.common.devices import Chip
from maxtrain.config import Config
from maxtrain.config.loading import deep_merge, validate
from maxtrain.planning.candidates import Candidate
from maxtrain.training import metrics, run_model

# The forward passes a step computes per policy, over the one forward + two backward units of
# the model's FLOPs: full recomputes the whole forward, minimal its cheap element-wise parts.
REMAT_FLOPS = {"none": 1.0, "minimal": 1.05, "full": 4 / 3}


@dataclass(frozen=True)
class Screened:
    candidate: Candidate
    estimate_gib: float  # the memory estimate per chip
    first_order_s: float


def with_layout(cfg: Config, candidate: Candidate) -> Config:
    """The config with the candidate's keys set, validated as a loaded config is."""
    return validate(deep_merge(cfg.model_dump(), candidate.overlay()))


def screen(
    cfg: Config, candidates: list[Candidate], chip: Chip, chips_per_slice: int
) -> tuple[list[Screened], Counter]:
    """(the candidates that may fit, fastest first by the first-order time; why the others
    were dropped, with how many)."""
    dropped: Counter = Counter()
    fits: dict[tuple, Screened] = {}
    for c in sorted(candidates, key=lambda c: c.grad_accum):
        same_but_accum = (c.ici, c.dcn, c.remat, c.pipeline_microbatches, c.expert_exchange,
                          c.context_exchange)  # fmt: skip
        if same_but_accum in fits:
            dropped["more micro-batches than memory needs (dominated)"] += 1
            continue
        gib = estimate_gib(cfg, c, chip, chips_per_slice)
        if gib > MARGIN * chip.hbm_gib:
            dropped[f"memory estimate over {MARGIN:g} x HBM"] += 1
            continue
        fits[same_but_accum] = Screened(c, gib, first_order_seconds(cfg, c, chip))
    # those the estimate says fit outright first: the margin admits some the compiler refuses
    order = lambda s: (s.estimate_gib > chip.hbm_gib, s.first_order_s, s.estimate_gib)  # noqa: E731
    return sorted(fits.values(), key=order), dropped


def estimate_gib(cfg: Config, c: Candidate, chip: Chip, chips_per_slice: int) -> float:
    """The memory estimate per chip of the config laid out as `c`, with the choices a run makes
    for the chip (kernels, compute dtype)."""
    layout = run_model.for_platform(
        with_layout(cfg, c), chip.platform, chip.kinds[0], chips_per_slice
    )
    devices = chips_per_slice * math.prod(c.dcn)
    return round(memory.estimate(layout, devices, _model_def(layout)).total / 2**30, 2)


_MODEL_DEFS: dict[str, object] = {}


def _model_def(cfg: Config):
    """run_model.model_def(cfg), built once per config but its mesh, of which only the stages
    shape the model (the other axes shard it)."""
    key = cfg.model_dump_json(exclude={"mesh"}) + str(cfg.mesh.stage * cfg.mesh.dcn.stage)
    if key not in _MODEL_DEFS:
        _MODEL_DEFS[key] = run_model.model_def(cfg)
    return _MODEL_DEFS[key]


def first_order_seconds(cfg: Config, c: Candidate, chip: Chip) -> float:
    """See the module docstring: an order for the compiles, not a prediction."""
    chips = math.prod(c.ici) * math.prod(c.dcn)
    tokens = cfg.tokens_per_step
    flops = metrics.train_flops_per_token(cfg.model, cfg.train.seq_len) * tokens
    compute = flops * REMAT_FLOPS[c.remat] / chips / chip.peak_flops["bf16"]
    ring = chip.ring_bytes_per_s(2)
    weights = 2 * model_lib.param_count(cfg.model) / c.degree("stage")  # bf16 copies
    fsdp, data, tensor = c.degree("fsdp"), c.degree("data"), c.degree("tensor")
    gathers = 3 if c.remat == "full" else 2  # forward, backward (again under full remat)
    weight_s = c.grad_accum * gathers * weights / tensor * (fsdp - 1) / fsdp / ring
    weight_s += 2 * weights / tensor / fsdp * (data - 1) / data / ring
    per_chip_tokens = tokens / (chips / tensor)
    layers = cfg.model.num_layers / c.degree("stage")
    tensor_s = 4 * layers * per_chip_tokens * cfg.model.emb_dim * 2 * 2 * (tensor - 1)
    tensor_s /= tensor * ring
    context = c.degree("context")
    kv_width = cfg.model.resolved_kv_heads * cfg.model.resolved_head_dim
    # keys and values gathered whole in each layer, forward and backward, and their gradients
    tensor_s += 3 * layers * 2 * per_chip_tokens * kv_width * 2 * (context - 1) / ring
    stages = c.degree("stage")
    busy = 1.0
    if stages > 1:
        m = c.pipeline_microbatches
        busy = m / (m + stages - 1)
    return (max(compute, weight_s) + tensor_s) / busy
