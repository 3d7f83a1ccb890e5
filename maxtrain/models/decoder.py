"""The decoder: embed -> L x (token mixer, SwiGLU or MoE) pre-norm blocks -> norm -> logits.

Layer parameters are stored stacked, with a leading `layers` axis, whether the layers run under
`jax.lax.scan` (compile time independent of depth) or in an unrolled Python loop. One
parameter layout for both means checkpoints, converters and the upcycling/depth-upscaling tools
see the same tree either way.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config.model import Mixer
from maxtrain.layers import embedding
from maxtrain.layers.attention_pattern import kind_per_layer, model_kinds
from maxtrain.layers.attention_types import attention_type
from maxtrain.layers.base import Projection, make_param
from maxtrain.layers.gated_deltanet import GatedDeltaNet
from maxtrain.layers.kv_cache import Cache, StackCache, cache_kind
from maxtrain.layers.mlp import MLP
from maxtrain.layers.moe import MoE
from maxtrain.layers.norms import RMSNorm
from maxtrain.layers.routed_experts import ASSIGNMENT_ORDER
from maxtrain.layers.spec import ModelSpec
from maxtrain.models import qk_clip
from maxtrain.models.mtp import MultiTokenPrediction
from maxtrain.models.stacks import STACK_KINDS, STACKS, LayerKind, layer_kinds, layer_runs
from maxtrain.parallel.mesh import constrain

# Primitives of the fused attention kernels. Their outputs (attention output plus the small
# softmax statistics the kernel's backward needs) are cheap to keep and costly to recompute.
_KERNEL_PRIMITIVES = frozenset({"pallas_call", "remat_opt"})


# A matmul summing fewer values than this is recomputed rather than kept: an adapter's (x A) B
# (maxtrain/posttrain/) contracts over the adapter rank, costs a rank/width share of its
# projection to recompute, and its output is as large as the projection's.
_RECOMPUTED_CONTRACTION = 128


def _save_matmuls_and_kernels(prim, *args, **params) -> bool:
    if prim.name in _KERNEL_PRIMITIVES:
        return True
    if not jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params):
        return False
    (contracting, _), _ = params["dimension_numbers"]
    return math.prod(args[0].shape[d] for d in contracting) >= _RECOMPUTED_CONTRACTION


# An MoE layer's order of its assignments by expert ([tokens x k] integers, a 1/(2 D) share of
# its input in bf16) is kept by every policy: recomputed, it would be a second sort per layer
# and step (layers/routed_experts.py).
_KEEP_ORDER = jax.checkpoint_policies.save_only_these_names(ASSIGNMENT_ORDER)

# What the backward pass may keep instead of recomputing, by config name.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # no rematerialisation: keep every activation
    "full": _KEEP_ORDER,  # keep only each layer's input (and the MoE's order)
    # keep projection outputs and attention kernel outputs
    "minimal": jax.checkpoint_policies.save_from_both_policies(
        _save_matmuls_and_kernels, _KEEP_ORDER
    ),
}


# A layer's attention kind: an index into its model's attention_pattern.model_kinds, a constant
# for a run of layers of one kind, else a traced scalar the scan hands each layer.
type Kind = int | jax.Array


def run_kinds(kinds: tuple[int, ...]) -> Kind:
    """A run's per-layer attention kinds as run_stack takes them: one constant if all alike."""
    return kinds[0] if len(set(kinds)) == 1 else jnp.asarray(kinds, jnp.int32)


@dataclass(frozen=True)
class BlockKind:
    """A kind of decoder layer: the params key of its stack (models/stacks.py), its token mixer
    and its feed-forward block, kept under the attributes `mixer_name` and `ffn_name` (keys of
    the checkpoint format). Factories: (spec, *, rngs) -> module."""

    stack: str
    mixer_name: str
    make_mixer: Callable[..., nnx.Module]
    ffn_name: str
    make_ffn: Callable[..., nnx.Module]


def _attention(spec: ModelSpec, *, rngs: nnx.Rngs) -> nnx.Module:
    """The model's softmax attention (GQA, or MLA with model.mla)."""
    return attention_type(spec.model)(spec, rngs=rngs)


def _linear_attention(spec: ModelSpec, *, rngs: nnx.Rngs) -> nnx.Module:
    """model.linear_attention's: Gated DeltaNet (with channel_decay Kimi Delta Attention)."""
    cfg, la = spec.model, spec.model.linear_attention
    assert la is not None  # a linear layer implies it (config validation)
    heads = (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim)
    return GatedDeltaNet(
        cfg.emb_dim,
        *heads,
        conv_kernel=la.conv_kernel,
        chunk=la.chunk,
        channel_decay=la.channel_decay,
        norm_eps=cfg.norm_eps,
        **spec.projection(rngs),
    )


_MIXERS = {"attention": ("attn", _attention), "linear": ("linear_attn", _linear_attention)}
_FFNS = {False: ("mlp", MLP), True: ("moe", MoE)}  # is_moe -> (attribute, factory)
# LayerKind -> BlockKind, in the order of STACKS (the order the decoder creates its stacks in).
BLOCK_KINDS = {
    kind: BlockKind(stack, *_MIXERS[kind.mixer], *_FFNS[kind.is_moe])
    for kind, stack in STACKS.items()
}


class DecoderBlock(nnx.Module):
    """Pre-norm token mixer then feed-forward block, those this kind of layer was built with;
    with model.block_norms sandwich, each one's output is normed too before it joins the
    residual stream (attn_post_norm, mlp_post_norm)."""

    def __init__(self, spec: ModelSpec, kind: BlockKind, *, rngs: nnx.Rngs):
        cfg = spec.model
        norm_kw = dict(
            eps=cfg.norm_eps,
            param_dtype=spec.param_dtype,
            rngs=rngs,
            plus_one=cfg.norm_scale_plus_one,
        )
        self.attn_norm = RMSNorm(cfg.emb_dim, **norm_kw)
        self.mixer_name = kind.mixer_name
        # Attention's max logits (compute.attention_max_logit) and its indexer's statistics
        # (DeepSeek sparse attention, layers/mla.py) join the block's statistics.
        self.max_logit = spec.compute.attention_max_logit and kind.mixer_name == qk_clip.MIXER
        self.indexer_stats = kind.mixer_name == qk_clip.MIXER and bool(cfg.mla and cfg.mla.indexer)
        setattr(self, kind.mixer_name, kind.make_mixer(spec, rngs=rngs))
        self.mlp_norm = RMSNorm(cfg.emb_dim, **norm_kw)
        self.ffn_name = kind.ffn_name
        setattr(self, kind.ffn_name, kind.make_ffn(spec, rngs=rngs))
        sandwich = cfg.block_norms == "sandwich"
        self.attn_post_norm = RMSNorm(cfg.emb_dim, **norm_kw) if sandwich else None
        self.mlp_post_norm = RMSNorm(cfg.emb_dim, **norm_kw) if sandwich else None

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kind: Kind = 0
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Returns the new residual stream [B, T, D] and the feed-forward's statistics (and
        attention's, where the block reports them: max logits, qk_clip.MAX_LOGIT [N], or the
        indexer's); `kind` is the layer's attention kind's index (attention_pattern.py)."""
        mixer = getattr(self, self.mixer_name)
        attn_out, attn_stats = mixer(self.attn_norm(x), positions, segment_ids, kind), {}
        if self.max_logit or self.indexer_stats:
            attn_out, attn_stats = attn_out
            attn_stats = {qk_clip.MAX_LOGIT: attn_stats} if self.max_logit else attn_stats
        x = x + _normed(self.attn_post_norm, attn_out)
        ffn_out, stats = getattr(self, self.ffn_name)(self.mlp_norm(x))
        x = x + _normed(self.mlp_post_norm, ffn_out)
        return constrain(x, ("batch", "length", "act_embed")), {**stats, **attn_stats}

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: Cache, kind: int = 0
    ) -> tuple[jax.Array, Cache]:
        """The block on new tokens with the layer's decode cache (generation); the
        feed-forward's statistics are of no use there."""
        mixer = getattr(self, self.mixer_name)
        attn_out, cache = mixer.cached(self.attn_norm(x), positions, cache, kind)
        x = x + _normed(self.attn_post_norm, attn_out)
        ffn_out, _ = getattr(self, self.ffn_name)(self.mlp_norm(x))
        x = x + _normed(self.mlp_post_norm, ffn_out)
        return constrain(x, ("batch", "length", "act_embed")), cache


def _normed(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    """A sublayer's output as it joins the residual stream: normed where the block has a
    post-norm (sandwich), else as it is."""
    return x if norm is None else norm(x)


def stacked_blocks(
    spec: ModelSpec, kind: BlockKind, counts: tuple[tuple[str, int], ...], *, rngs: nnx.Rngs
) -> DecoderBlock | None:
    """`kind` blocks stacked on leading axes: counts [(logical axis name, size), ...], outermost
    first; None when any size is 0. Each axis prepends its name to the parameters' logical
    axes (e.g. ("layers", "embed", "heads", ...))."""
    if any(size == 0 for _, size in counts):
        return None
    (name, size), inner = counts[0], counts[1:]

    @nnx.split_rngs(splits=size)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: name})
    def stack(rngs: nnx.Rngs) -> DecoderBlock:
        if inner:
            return stacked_blocks(spec, kind, inner, rngs=rngs)
        return DecoderBlock(spec, kind, rngs=rngs)

    return stack(rngs)


def dequantized(layer_state: nnx.State) -> nnx.State:
    """One layer's parameters with any Qwix QArray (an adapted run's quantized frozen base,
    maxtrain/posttrain/)
    multiplied out in float32. Called per layer inside the layer loop, so that one layer's float
    copy exists at a time. Without Qwix loaded no parameter can be quantized: nothing to do."""
    qwix = sys.modules.get("qwix")
    if qwix is None:
        return layer_state
    for _, var in nnx.to_flat_state(layer_state):
        value = var.get_value()
        if isinstance(value, qwix.QArray):
            var.set_value(qwix.dequantize(value).astype(jnp.float32))
    return layer_state


def apply_layer(
    graphdef: nnx.GraphDef,
    layer_state: nnx.State,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    kind: Kind,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One layer of a stack (its graphdef, one layer's state) on x [B, T, D]: the new residual
    stream and the layer's statistics."""
    block = nnx.merge(graphdef, dequantized(layer_state))
    return block(x, positions, segment_ids, kind)


def run_stack(
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    start: int,
    length: int,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    kinds: tuple[int, ...],
    remat: str,
    scan: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Runs layers [start, start + length) of a stack (its graphdef and state, leading layer
    axis), of attention kinds `kinds` (one per layer run); per-layer statistics come back
    stacked along a leading layer axis."""
    if start != 0 or length != jax.tree.leaves(stacked)[0].shape[0]:
        stacked = jax.tree.map(lambda a: a[start : start + length], stacked)

    def layer_fn(kind: int | None) -> Callable:
        """One layer's step: of a constant kind, or (kind None) of the kind scanned with it."""

        def apply_one(x, layer):
            layer_state, layer_kind = layer if kind is None else (layer, kind)
            return apply_layer(graphdef, layer_state, x, positions, segment_ids, layer_kind)

        if remat == "none":
            return apply_one
        return jax.checkpoint(apply_one, policy=REMAT_POLICIES[remat], prevent_cse=not scan)

    if scan:
        per_layer_kind = run_kinds(kinds)
        if isinstance(per_layer_kind, int):
            return jax.lax.scan(layer_fn(per_layer_kind), x, stacked)
        return jax.lax.scan(layer_fn(None), x, (stacked, per_layer_kind))
    per_layer = []
    for i in range(length):
        x, stats = layer_fn(kinds[i])(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        per_layer.append(stats)
    return x, jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer)


def run_stack_cached(
    graphdef: nnx.GraphDef,
    stacked: nnx.State,
    start: int,
    length: int,
    x: jax.Array,
    positions: jax.Array,
    cache: StackCache,
    kinds: tuple[int, ...],
    ranks: tuple[int, ...],
    mixer: Mixer,
    names: tuple[str, ...],
) -> tuple[jax.Array, StackCache]:
    """Layers [start, start + length) of a stack on new tokens; returns the updated caches.
    `cache` holds the stack's caches per cache kind ([L_kind, ...], layers/kv_cache.py
    cache_kind: the attention kind's, or one for `mixer` linear), of which layer i of the run
    (attention kind kinds[i], an index into `names`, the model's model_kinds) owns entry
    ranks[i] of its kind's.

    The scan runs over the layers' parameters and carries the caches: the kinds' caches differ
    in length (a global layer's all positions, a local one's a window), so they cannot be
    scanned over together. Each layer (picked by lax.switch on its kind where a run mixes
    kinds) reads its own entry and writes it back in place: per layer, the work and memory
    traffic of its own cache alone, and no second copy of the whole cache."""
    whole = length == jax.tree.leaves(stacked)[0].shape[0]
    layers = lambda tree: tree if whole else jax.tree.map(lambda a: a[start : start + length], tree)
    constant = len(set(kinds)) == 1

    def apply_one(carry, layer):
        x, caches = carry
        layer_state, kind, rank = layer
        block = nnx.merge(graphdef, dequantized(layer_state))

        def of_kind(k: int) -> Callable:
            name = cache_kind(mixer, names[k])

            def run(x, caches):
                own = jax.tree.map(lambda a: a[rank], caches[name])
                x, own = block.cached(x, positions, own, k)
                put = lambda c, u: jax.lax.dynamic_update_index_in_dim(c, u, rank, axis=0)
                return x, {**caches, name: jax.tree.map(put, caches[name], own)}

            return run

        if constant:
            return of_kind(kinds[0])(x, caches), None
        return jax.lax.switch(kind, [of_kind(k) for k in range(len(names))], x, caches), None

    per_layer = (jnp.asarray(kinds, jnp.int32), jnp.asarray(ranks, jnp.int32))
    (x, cache), _ = jax.lax.scan(apply_one, (x, cache), (layers(stacked), *per_layer))
    return x, cache


def cache_ranks(
    runs: tuple[tuple[str, int, int, tuple[int, ...]], ...],
) -> tuple[tuple[int, ...], ...]:
    """Per run of runs_with_attention (in model order), each layer's rank among its stack's
    layers of its attention kind: its entry in that kind's cache (layers/kv_cache.py)."""
    seen: dict[tuple[str, int], int] = {}
    found = []
    for stack, _, _, kinds in runs:
        ranks = []
        for kind in kinds:
            ranks.append(seen.get((stack, kind), 0))
            seen[stack, kind] = ranks[-1] + 1
        found.append(tuple(ranks))
    return tuple(found)


def runs_with_attention(
    runs: list[tuple[LayerKind, int, int]], attention: tuple[int, ...]
) -> tuple[tuple[str, int, int, tuple[int, ...]], ...]:
    """stacks.layer_runs of consecutive layers -> (stack, start, length, their attention kinds);
    `attention` holds the kind of each layer the runs cover, in order."""
    found, first = [], 0
    for layer_kind, start, length in runs:
        kinds = attention[first : first + length]
        found.append((STACKS[layer_kind], start, length, kinds))
        first += length
    return tuple(found)


def concatenate_runs(per_run: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """Statistics of consecutive runs of layers, joined along the layer axis ({} if none):
    each key over the runs that have it (MoE's over the MoE layers, attention's max logits
    over the attention layers), in model order."""
    keys = dict.fromkeys(key for stats in per_run for key in stats)
    return {key: jnp.concatenate([stats[key] for stats in per_run if key in stats]) for key in keys}


class Decoder(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        cfg = spec.model
        D, V = cfg.emb_dim, cfg.vocab_size
        self.compute_dtype = spec.compute_dtype
        self.scan_layers = spec.compute.scan_layers
        self.remat = spec.compute.remat
        self.attention_kinds = model_kinds(cfg)
        self.embedding = make_param(
            rngs, (V, D), ("vocab", "embed"), std=spec.init_std, dtype=spec.param_dtype
        )
        self._build_layers(spec, rngs)
        self.final_norm = RMSNorm(
            D,
            eps=cfg.norm_eps,
            param_dtype=spec.param_dtype,
            rngs=rngs,
            plus_one=cfg.norm_scale_plus_one,
        )
        # Gemma: the embeddings times sqrt(D), the factor rounded to the compute dtype first
        # (transformers rounds it to the weights' dtype: sqrt(5376) is 73.5 in bfloat16).
        self.embed_scale = math.sqrt(D) if cfg.scale_embeddings else None
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Projection("btd,dv->btv", (D, V), ("embed", "vocab"), **spec.projection(rngs))
        )
        # Created last, so that the decoder initialises the same with or without it.
        self.mtp = (
            MultiTokenPrediction(
                spec,
                # A block of the kind of the last layer (DeepSeek-V3's is MoE).
                lambda: DecoderBlock(spec, BLOCK_KINDS[layer_kinds(cfg)[-1]], rngs=rngs),
                rngs=rngs,
            )
            if cfg.mtp.depth
            else None
        )

    def _build_layers(self, spec: ModelSpec, rngs: nnx.Rngs) -> None:
        """One stack per kind of layer (models/stacks.py), run as consecutive runs."""
        kinds = layer_kinds(spec.model)
        self.runs = runs_with_attention(layer_runs(kinds), kind_per_layer(spec.model))
        # Created in this order (dense stack first) so the random initialisation stays the same.
        for layer_kind, kind in BLOCK_KINDS.items():
            counts = (("layers", kinds.count(layer_kind)),)
            setattr(self, kind.stack, stacked_blocks(spec, kind, counts, rngs=rngs))

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        targets: jax.Array | None = None,
        loss_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """tokens/positions/segment_ids: [B, T] int32 -> (logits [B, T, V] in compute dtype,
        statistics of the blocks that return any (MoE: the router's), stacked in layer order).
        Given the targets and loss mask, the multi-token prediction modules (models/mtp.py), if
        any, add their loss statistics."""
        embedded = self._embed(tokens)
        hidden, stats = self._layers(embedded, positions, segment_ids)
        if self.mtp is not None and targets is not None:
            mtp_stats = self.mtp(
                hidden, embedded, self._head, positions, segment_ids, targets, loss_mask
            )
            stats = {**stats, **mtp_stats}
        return self._head(self.final_norm(hidden)), stats

    def decode(
        self, tokens: jax.Array, positions: jax.Array, cache: dict[str, StackCache]
    ) -> tuple[jax.Array, dict[str, StackCache]]:
        """Generation: new tokens [B, T] at positions [B, T] (consecutive per row; -1: a
        prefill's right padding) -> their logits [B, T, V] and the cache
        (maxtrain/layers/kv_cache.py) with their entries (keys and values, or MLA's latents)
        added and linear layers' states advanced past them. A token sees the cached positions
        before its own that its layer's kind lets it."""
        x, cache = self._embed(tokens), dict(cache)
        for (stack, start, length, kinds), ranks in zip(
            self.runs, cache_ranks(self.runs), strict=True
        ):
            graphdef, stacked = nnx.split(getattr(self, stack))
            x, cache[stack] = run_stack_cached(
                graphdef, stacked, start, length, x, positions, cache[stack], kinds, ranks,
                STACK_KINDS[stack].mixer, self.attention_kinds,
            )  # fmt: skip
        return self._head(self.final_norm(x)), cache

    def _embed(self, tokens: jax.Array) -> jax.Array:
        embedded = embedding.lookup(self.embedding[...], tokens, self.compute_dtype)
        if self.embed_scale is None:
            return embedded
        return embedded * jnp.asarray(self.embed_scale, self.compute_dtype)

    def _head(self, x: jax.Array) -> jax.Array:
        return head_logits(self, x)

    head_batch = "batch"  # the logical axis the head's batch dim is split over

    def _layers(self, x, positions, segment_ids) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self._run_layers(self.runs, x, positions, segment_ids)

    def _run_layers(
        self, runs, x, positions, segment_ids
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs of runs_with_attention, in order, from this module's stacks."""
        per_run = []
        for stack, start, length, kinds in runs:
            graphdef, stacked = nnx.split(getattr(self, stack))
            x, stats = run_stack(
                graphdef, stacked, start, length, x, positions, segment_ids, kinds=kinds,
                **self._run_options,
            )  # fmt: skip
            per_run.append(stats)
        return x, concatenate_runs(per_run)

    @property
    def _run_options(self) -> dict:
        return {"remat": self.remat, "scan": self.scan_layers}


def head_logits(decoder: nnx.Module, x: jax.Array) -> jax.Array:
    """Normalised states [B, T, D] -> logits [B, T, V], by the decoder's head (its tied
    embedding table, still sharded, or lm_head), the batch split over its head_batch axis."""
    x = constrain(x, (decoder.head_batch, "length", "act_embed"))
    if decoder.lm_head is None:
        table = decoder.embedding[...].astype(decoder.compute_dtype)
        logits = jnp.einsum("btd,vd->btv", x, table)
    else:
        logits = decoder.lm_head(x)
    return constrain(logits, (decoder.head_batch, "length", "vocab"))
