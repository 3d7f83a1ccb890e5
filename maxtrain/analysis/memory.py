"""Per-device memory of a training step, estimated from the config alone (no devices needed).

`tools/benchmark.py --dry-run` prints it so a user can see whether a recipe fits before
paying for a slice. The parts:

  params, optimizer   each parameter's shard on one device (exact: the same logical-axis
                      rules and divisibility fallbacks the real run uses), and AdamW's two
                      moments, stored in the parameter dtype; with optim.name muon one
                      momentum per weight matrix (maxtrain/optim/muon.py) and AdamW's two for the
                      rest
  optimizer_scratch   muon: Newton-Schulz's working set for the stacked parameter that needs
                      the most: the matrices dealt to this device (optim/muon_deal.py), whole,
                      twice (muon_scratch)
  gradients           one parameter-shaped buffer (two with gradient accumulation: the running
                      sum and the current micro-batch's)
  activations         what the backward pass keeps per layer under the remat policy, for one
                      micro-batch, plus one layer's recomputation working set (and the
                      plain-XLA kernel's scores: [T, T] per head, a band of 2 x window keys
                      where every layer is local)
  logits              the [tokens, vocab] logits and their gradient (the loss never makes a
                      float32 copy)
  frozen              what the run holds and does not train (training/split.py): DPO's
                      reference, a second copy of the parameters; or a LoRA run's base model as
                      stored: its parameters in param_dtype, except under lora.base_quantization
                      the layer kernels it adapts, as quantized values (int8 1 byte, int4/nf4
                      half a byte) and float32 scales; `params`, `optimizer` and `gradients`
                      are then the adapters' alone

With pipeline stages (parallel/pipeline.py) a device holds its stage's layers only. Under gpipe
and circular the backward pass keeps every iteration's activations: R x M + S - 1 iterations of
one group of layers on one micro-batch (1/M of the tokens), about 1/S of the layers' activations
plus the bubble's share. The in-schedule tables (1f1b, interleaved, zero bubble:
parallel/scheduled.py) keep each layer's input only, for the units in flight (the table's
`in_flight`, which does not grow with M), and zero bubble also each projection's input and
output gradient for the units whose weight gradient is pending. The buffer of micro-batches
waiting for their next repeat holds the whole batch's layer input, the leading dense layers run
on every stage with the whole batch, and the head splits the batch over the stages (the
`stage_batch` rule), so the logits are 1/S; under the in-schedule tables the last stage takes
one micro-batch's logits at a time, 1/M.

The activation model is deliberately simple (per-token byte counts per layer; see
`_saved_per_token`). tests/analysis/test_memory.py checks the whole estimate against XLA's own
buffer assignment for compiled CPU steps (within 30%); on the H100 it gives 44.2 GiB for
recipes/h100/dense-1.5b.yml, whose measured peak is 39.4 GiB.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from maxtrain.common import devices
from maxtrain.config import MESH_AXES, Config
from maxtrain.kernels.attention import attention_implementation
from maxtrain.kernels.grouped_matmul import grouped_matmul_implementation
from maxtrain.kernels.xla_attention import banded_keys
from maxtrain.layers.attention_pattern import model_kinds, span
from maxtrain.layers.attention_types import mixer_counts
from maxtrain.models import ModelDef, compute_dtype
from maxtrain.models.stacks import LayerKind, is_moe_per_layer, layer_kinds
from maxtrain.optim import muon, muon_deal
from maxtrain.parallel.expert_exchanges import exchange_implementation, routed_capacity
from maxtrain.parallel.mesh import axis_sizes, spec_axes
from maxtrain.parallel.pipeline import StageLayout
from maxtrain.posttrain import parameter_split
from maxtrain.training.run_model import model_def, stage_layout
from maxtrain.training.state import leaf_specs

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    params: int
    optimizer: int
    optimizer_scratch: int
    gradients: int
    activations: int
    logits: int
    frozen: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_gib(self) -> dict[str, float]:
        return {k: round(v / 2**30, 3) for k, v in {**asdict(self), "total": self.total}.items()}


def device_memory_gib(device_kind: str) -> float | None:
    """The memory of one device of this kind, from the chip table (maxtrain/common/devices.py),
    or None when it is not known (CPU). What a run can allocate is somewhat less: the runtime
    keeps some, and JAX on GPU preallocates 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION
    says otherwise."""
    chip = devices.chip(device_kind)
    return None if chip is None else chip.hbm_gib


def fit(estimate_gib: float, device_kind: str) -> dict[str, object]:
    """Whether an estimated per-device total fits a device kind, and by how much:
    {device, device_memory_gib, fits, headroom_gib (negative: short by that much)}."""
    capacity = device_memory_gib(device_kind)
    return {
        "device": device_kind,
        "device_memory_gib": capacity,
        "fits": None if capacity is None else estimate_gib <= capacity,
        "headroom_gib": None if capacity is None else round(capacity - estimate_gib, 3),
    }


def estimate(cfg: Config, num_devices: int, mdef: ModelDef | None = None) -> MemoryEstimate:
    """The estimate for `num_devices` devices; `mdef`: the run's model_def(cfg), where the
    caller has it (a plan estimates many meshes of one model; building it takes a second)."""
    sizes = axis_sizes(cfg.mesh, num_devices)
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    param_bytes = _BYTES[cfg.compute.param_dtype]
    trained, frozen = _param_shards(cfg, mesh, mdef or model_def(cfg))
    params = sum(_shard_bytes(leaf, shard) for _, leaf, shard in trained)  # adapters: float32
    moments, scratch = 2 * params, 0
    if cfg.optim.name == "muon":
        moments, scratch = _muon_state_and_scratch(trained, param_bytes)
    batch_ways = math.prod(sizes[a] for a in cfg.mesh.rules.get("batch", []))
    length_ways = math.prod(sizes[a] for a in cfg.mesh.rules.get("length", []))
    batch = math.ceil(cfg.micro_batch_size / batch_ways)
    length = math.ceil(cfg.train.seq_len / length_ways)
    tokens = batch * length
    c = jnp.dtype(compute_dtype(cfg.compute)).itemsize
    layout = stage_layout(cfg)
    activations = _activation_bytes(cfg, sizes, batch, length, c, layout)
    head_tokens = tokens // (layout.stages if layout else 1)
    if layout is not None and layout.in_schedule:  # the last stage, a micro-batch at a time
        head_tokens = tokens // layout.microbatches
    # no float32 copy: kernels/cross_entropy.py
    logits = 2 * head_tokens * cfg.model.vocab_size * c
    # Multi-token prediction (models/mtp.py): per module, its logits and its block, not remat'd.
    depth = cfg.model.mtp.depth
    if depth:
        logits *= 1 + depth
        last = LayerKind("attention", is_moe_per_layer(cfg.model)[-1])  # global attention
        activations += depth * tokens * _saved_per_token(cfg, last, c, policy="none")
    return MemoryEstimate(
        params=params,
        optimizer=moments,
        optimizer_scratch=scratch,
        gradients=params * (2 if cfg.train.grad_accum_steps > 1 else 1),
        activations=activations,
        logits=logits,
        frozen=sum(_shard_bytes(leaf, shard) for _, leaf, shard in frozen),
    )


Shard = tuple[tuple, jax.ShapeDtypeStruct, list[int]]  # (path, leaf, the shape one device holds)


def _param_shards(
    cfg: Config, mesh: AbstractMesh, mdef: ModelDef
) -> tuple[list[Shard], list[Shard]]:
    """The trained parameters' shards and the frozen base's (none without LoRA), split exactly
    as the train state's shardings split them (training/state.py leaf_specs)."""
    trained, frozen = _params(cfg, mdef)

    def shards(tree: dict) -> list[Shard]:
        specs = jax.tree.leaves(
            leaf_specs(tree, mdef.abstract_state, cfg.mesh.rules, mesh),
            is_leaf=lambda x: isinstance(x, P),
        )
        out = []
        for (path, leaf), spec in zip(
            jax.tree_util.tree_flatten_with_path(tree)[0], specs, strict=True
        ):
            shard = [
                dim // math.prod(mesh.shape[a] for a in spec_axes(part))
                for dim, part in zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim, strict=False)
            ]
            out.append((path, leaf, shard))
        return out

    return shards(trained), shards(frozen)


def _params(cfg: Config, mdef: ModelDef) -> tuple[dict, dict]:
    """(trained, frozen): the model's parameters as shapes, split as the train state splits
    them (training/split.py), the frozen part as the state stores it (QLoRA: quantized)."""
    split = parameter_split(cfg)
    trained, frozen = split.split(nnx.to_pure_dict(mdef.abstract_state))
    if frozen is None:
        return trained, {}
    stored = functools.partial(split.stored, abstract_state=mdef.abstract_state)
    return trained, jax.eval_shape(stored, frozen)


def _shard_bytes(leaf: jax.ShapeDtypeStruct, shard: list[int]) -> int:
    """Bytes of one device's shard of a leaf: 4-bit values (int4, nf4) packed two per byte."""
    return math.ceil(math.prod(shard) * jax.dtypes.itemsize_bits(leaf.dtype) / 8)


def _muon_state_and_scratch(shards: list[Shard], param_bytes: int) -> tuple[int, int]:
    """Muon's state (one momentum per matrix, AdamW's two moments for the rest) and
    Newton-Schulz's working set for the parameter that needs the most, in bytes."""
    state = scratch = 0
    for path, leaf, shard in shards:
        dims = muon.matrix_dims(path)
        state += math.prod(shard) * (2 if dims is None else 1)
        if dims is not None:
            scratch = max(scratch, muon_scratch(leaf.shape, tuple(shard), dims, param_bytes))
    return state * param_bytes, scratch


def muon_scratch(shape: tuple, shard: tuple, dims: tuple[int, int], itemsize: int) -> int:
    """Bytes Newton-Schulz holds at once on one device for one stacked parameter: the matrices
    dealt to it (optim/muon_deal.py: ceil(K / G) of them, or its K whole ones where no device
    shares them), whole, twice: the iterate and the next. The Gram matrices (min(m, n)^2 <=
    m x n) and the deal's buffers fit where the step's own buffers are free then (its update's
    output, the block the deal received): the TPU compiler assigns 2.0 matrices per dealt
    matrix for llama3-8b's MLP shape (tests/parallel/test_tpu_compile.py), and XLA:CPU as much
    with two per device (tests/optim/test_muon_deal.py); with one, XLA:CPU holds a third."""
    matrix = len(shape) - sum(dims)
    m, n = math.prod(shape[matrix : matrix + dims[0]]), math.prod(shape[matrix + dims[0] :])
    deal = muon_deal.plan(tuple(shape), tuple(shard), sum(dims))
    return deal.per_device * 2 * m * n * itemsize


def _activation_bytes(
    cfg: Config, sizes: dict[str, int], batch: int, length: int, c: int, layout: StageLayout | None
) -> int:
    model = cfg.model
    kinds = layer_kinds(model)
    # (layers, sequences per pass, passes whose activations the backward keeps, remat policy)
    policy = cfg.compute.remat
    if layout is None:
        runs = [(kinds, batch, 1, policy)]
    else:
        micro = batch // layout.microbatches
        stages = (layout.group, micro, layout.iterations, policy)
        if layout.in_schedule:  # the layers' inputs of the units in flight
            stages = (layout.group, micro, layout.table.in_flight(), "full")
        runs = [(kinds[: len(layout.prologue)], batch, 1, policy), stages]
    kept = working = scores = dispatch = 0
    for layers, rows, passes, policy in runs:
        if not layers:
            continue
        tokens = rows * length
        kept += passes * tokens * sum(_saved_per_token(cfg, kind, c, policy) for kind in layers)
        per_token = max(_saved_per_token(cfg, kind, c, policy="none") for kind in layers)
        working = max(working, tokens * per_token)
        # Keys a device's queries meet at once: the whole sequence, or under context
        # parallelism with the ring exchange one block (parallel/context.py).
        split = length < cfg.train.seq_len
        keys = length if split and cfg.compute.context_exchange == "ring" else cfg.train.seq_len
        if not split:  # local layers' plain-XLA kernel scores a band of keys only
            keys = _reference_keys(model, keys)
        if split or attention_implementation(cfg.compute.attention) == "xla":
            # The reference attention materialises float32 scores and probabilities of one
            # layer at a time (its custom VJP keeps neither for the backward); every block of a
            # split sequence keeps them, every layer's without remat.
            count = passes * len(layers) if split and cfg.compute.remat == "none" else 1
            scores += count * 2 * 4 * rows * model.num_heads * length * keys
        if split:  # the exchanged K and V (all_gather: the whole sequence)
            kv = 2 * rows * keys * model.resolved_kv_heads * model.resolved_head_dim * c
            working = max(working, tokens * per_token + kv)
        if any(kind.is_moe for kind in layers):
            dispatch = max(dispatch, _moe_dispatch_bytes(cfg, sizes, tokens, c))
    if layout is not None:  # the micro-batches between repeats, and their gradient
        kept += 2 * batch * length * model.emb_dim * c
    if layout is not None and layout.table.splits_backward:  # zero bubble's pending units
        units = layout.table.buffer_slots(layout.table.pending)
        micro_tokens = batch // layout.microbatches * length
        kept += units * micro_tokens * sum(_projection_pairs(model, k) for k in layout.group) * c
    # The score arrays live inside attention and the dispatch buffers inside the MoE layer:
    # never at once, each beside the recomputed layer's working set.
    return kept + working + max(scores, dispatch)


def _projection_pairs(model, kind: LayerKind) -> int:
    """Elements per token of a layer's projections' inputs and output gradients, which zero
    bubble keeps from a unit's input gradient to its weight gradient
    (parallel/split_backward.py): attention's q, k, v and output, the MLP's (or each routed
    expert's, top_k times) gate, up and down."""
    D, H = model.emb_dim, model.resolved_head_dim
    q, kv = model.num_heads * H, model.resolved_kv_heads * H
    attention = 3 * D + q + 2 * kv + q + D
    width, copies = model.mlp_dim, 1
    if kind.is_moe:
        width, copies = model.moe.expert_mlp_dim, model.moe.top_k
    return attention + copies * (2 * D + 2 * width + width + D)


def _reference_keys(model, seq_len: int) -> int:
    """Keys per query of the largest score array any layer's plain-XLA kernel holds: the whole
    sequence if a layer is global (multi-token prediction's blocks are), else the band of the
    local layers' window or chunk (kernels/xla_attention.py banded_attention)."""
    spans = {span(model, kind) for kind in model_kinds(model)}
    if model.mtp.depth:
        spans.add(None)
    return max(banded_keys(span, seq_len) for span in spans)


def _moe_dispatch_bytes(cfg: Config, sizes: dict[str, int], tokens: int, c: int) -> int:
    """One MoE layer's dispatch buffers, alive while it runs (forward or recomputation)."""
    m = cfg.model.moe
    if m is None:
        return 0
    D, Fe, routed = cfg.model.emb_dim, m.expert_mlp_dim, tokens * m.top_k
    ways = math.prod(sizes[a] for a in cfg.mesh.rules.get("exp", []))
    computed = routed  # rows through the experts on this device
    sorted_rows = routed  # the assignments' rows in expert order
    # Expert-parallel buffers of routed rows (parallel/expert_exchanges.py), those of one round:
    # further rounds (compute.expert_exchange_overflow rounds) run one after another, reusing them.
    exchange = 0
    compute = cfg.compute
    if m.expert_capacity_factor is None and ways > 1:
        computed = routed_capacity(routed, compute.expert_exchange_capacity, ways * routed)
        name = exchange_implementation(compute.expert_exchange)
        if name == "all_to_all":  # the blocks sent and received, gathered from the tokens
            exchange, sorted_rows = 2 * computed, 0
        elif name == "ragged":  # the receive buffer, and the sorted rows the outputs return to
            exchange = computed + routed
        else:  # all_gather: every device's tokens, and their partial outputs
            exchange = 2 * ways * tokens
    # sorted rows, the experts' outputs, the exchange; gate and up (one [rows, 2F]), their product
    total = (sorted_rows + computed + exchange) * D * c + 3 * computed * Fe * c
    if grouped_matmul_implementation(compute.grouped_matmul) == "xla":
        # lax.ragged_dot lowers densely: every projection computed for every expert this
        # device holds (its share of them under expert parallelism).
        total += computed * (m.num_experts // ways) * (2 * Fe + D) * 4
    return total


def _saved_per_token(cfg: Config, kind: LayerKind, c: int, policy: str | None = None) -> int:
    """Bytes per token one layer keeps for its backward pass under a remat policy: its token
    mixer's (attention's K/V and scores' inputs, or a linear layer's projections and chunk
    states) and its feed-forward's."""
    model = cfg.model
    policy = policy or cfg.compute.remat
    D = model.emb_dim
    is_moe = kind.is_moe
    if policy == "full":
        return D * c  # the layer input only
    counts = mixer_counts(model, kind.mixer)
    attention = counts.saved * c + math.ceil(counts.state_bytes)
    if is_moe:
        m = model.moe
        ffn = m.num_experts * 4  # float32 router logits
        ffn += (2 * m.shared_experts * m.expert_mlp_dim + D) * c if m.shared_experts else 0
        tokamax = grouped_matmul_implementation(cfg.compute.grouped_matmul) == "tokamax"
        if policy == "none" or tokamax:
            ffn += m.top_k * (2 * m.expert_mlp_dim + D) * c  # kernel outputs are kept
    else:
        ffn = (2 * model.mlp_dim + D) * c  # gate, up, down
    if policy == "none":  # norms, residual sums, SwiGLU product: everything stays
        width = m.expert_mlp_dim * m.top_k if is_moe and model.moe else model.mlp_dim
        return attention + ffn + (4 * D + 2 * width) * c
    return attention + ffn
