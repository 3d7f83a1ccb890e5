"""Context parallelism: every sequence of the batch split over the `context` mesh axis.

With `mesh.context` (x `mesh.dcn.context`) = C > 1 the logical axis `length` is sharded over C
devices (mesh.rules.length), so every activation holds T / C tokens per device. Everything but
attention is per token and needs nothing more; attention needs every earlier key of a query's
document, which the exchange (`compute.context_exchange`) brings to the device:

- all_gather: each device gathers the K and V of the whole sequence ((C - 1) / C of them move
  per layer), then attends its queries to all of them. Simple, and cheap when K/V are small
  (GQA), at the cost of one whole sequence of K/V per device.
- ring: K/V blocks travel around the ring of context devices by `ppermute` (C - 1 passes per
  layer); each device attends its queries to the block it holds while the next one arrives,
  merging blocks with the online softmax (kernels/xla_attention.py merge_blocks). Per-device
  memory stays one block.

A sliding window masks by original token index too (block_attention), and sinks rescale the
merged output once, by the log-sum-exp over every block (kernels/sinks.py), never per
block. Chunked layers arrive as segment ids cut at the chunks (attention_pattern.py).

Layout (`compute.context_layout`): under a causal mask the query at index t attends to t + 1 keys,
so a contiguous split gives the last device most of the work. `balanced` cuts the sequence into
2C chunks and gives device i chunks i and 2C - 1 - i: every device gets the same number of
(query, key) pairs. The permutation is applied once, to the batch's per-token arrays, in the
train and eval step (`to_layout`); the loss is a sum over tokens, so nothing needs to be put
back in order. Attention masks by each token's index in the original sequence (carried with
the blocks), so any layout masks exactly as the unsplit sequence does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxtrain.config import ConfigError, ModelConfig
from maxtrain.kernels.sinks import with_sinks
from maxtrain.kernels.xla_attention import block_attention, merge_blocks
from maxtrain.parallel.mesh import active_rules, constrain

AXIS = "context"


def context_degree() -> int:
    """C: how many devices share each sequence while tracing under `sharding_rules` (else 1)."""
    active = active_rules()
    if active is None:
        return 1
    mesh, rules = active
    return mesh.shape[AXIS] if AXIS in rules.get("length", []) else 1


def layout_order(length: int, degree: int, layout: str) -> np.ndarray:
    """[T] the original index of each position of the laid-out sequence; device i holds
    positions [i * T / C, (i + 1) * T / C)."""
    if layout == "contiguous" or degree == 1:
        return np.arange(length)
    chunks = np.arange(length).reshape(2 * degree, -1)
    return chunks[[c for i in range(degree) for c in (i, 2 * degree - 1 - i)]].reshape(-1)


def attention_pairs(length: int, degree: int, layout: str) -> list[int]:
    """Causal (query, key) pairs of one document of `length` tokens whose queries each device
    holds: its attention work (FLOPs = 4 x pairs x heads x head_dim per layer, forward)."""
    per_device = layout_order(length, degree, layout).reshape(degree, -1)
    return [int((indices + 1).sum()) for indices in per_device]


def to_layout(batch: dict[str, jax.Array], layout: str) -> dict[str, jax.Array]:
    """The batch's [B, T] per-token arrays in the context layout (no-op unless C > 1)."""
    degree = context_degree()
    if degree == 1 or layout == "contiguous":
        return batch
    order = layout_order(next(iter(batch.values())).shape[1], degree, layout)
    return {key: constrain(x[:, order], ("batch", "length")) for key, x in batch.items()}


def _all_gather(q, k, v, segment_ids, index, *, degree: int, window: int | None):
    gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, tiled=True)
    return block_attention(
        q,
        gather(k, axis=1),
        gather(v, axis=1),
        segment_ids,
        gather(segment_ids, axis=1),
        index,
        gather(index, axis=0),
        window,
    )


def _ring(q, k, v, segment_ids, index, *, degree: int, window: int | None):
    ring = [(i, (i + 1) % degree) for i in range(degree)]
    # Recomputed in the backward pass, so that it keeps one block's scores at a time rather
    # than all C; the scan runs the blocks one after another (unrolled, XLA may schedule them
    # side by side and hold every block's scores at once).
    attend_block = jax.checkpoint(functools.partial(block_attention, window=window))

    def attend(block):
        block_k, block_v, block_segments, block_index = block
        return attend_block(q, block_k, block_v, segment_ids, block_segments, index, block_index)

    def step(carry, _):
        out, lse, block = carry
        # The next block is sent before this one is used, so the transfer can overlap the math.
        arriving = jax.lax.ppermute(block, AXIS, ring)
        out, lse = merge_blocks(out, lse, *attend(block))
        return (out, lse, arriving), None

    out, lse = attend((k, v, segment_ids, index))
    first = jax.lax.ppermute((k, v, segment_ids, index), AXIS, ring)
    (out, lse, last), _ = jax.lax.scan(step, (out, lse, first), None, length=degree - 2)
    return merge_blocks(out, lse, *attend(last))


# per device: (q, k, v, segment_ids, index) -> (output, log-sum-exp) over every key, float32
EXCHANGES: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "all_gather": _all_gather,
    "ring": _ring,
}


def context_attention(exchange: str, layout: str) -> Callable[..., jax.Array]:
    """The attention of a context-split sequence, picked once by the layer:
    (q [B, T, N, H], k, v [B, T, K, H], segment_ids [B, T], sinks [N] | None, window=None) in
    the context layout -> [B, T, N, H], causal within documents (and the last `window` keys).
    Only the context axis is manual (shard_map); the batch, heads and every other axis stay
    with XLA's partitioner, so it composes with fsdp, tensor, expert and stage."""
    exchange_fn = EXCHANGES[exchange]

    def attend(q, k, v, segment_ids, sinks=None, *, window: int | None = None):
        mesh, _ = active_rules()
        degree = mesh.shape[AXIS]
        index = jnp.asarray(layout_order(q.shape[1], degree, layout), jnp.int32)
        tokens, heads = P(None, AXIS), P(None, AXIS, None, None)

        def per_device(q, k, v, segment_ids, index, sinks):
            out, lse = exchange_fn(q, k, v, segment_ids, index, degree=degree, window=window)
            if sinks is not None:
                out = with_sinks(out, lse, sinks)
            return out.astype(q.dtype)

        return jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(heads, heads, heads, tokens, P(AXIS), None if sinks is None else P()),
            out_specs=heads,
            # Pipeline stages run the layers under vmap(spmd_axis_name="stage"), which maps the
            # stage dim onto that axis: it must be manual here too (the prologue replicates).
            axis_names={AXIS, *(["stage"] if mesh.shape["stage"] > 1 else [])},
            # The token indices are the same on every stage, the blocks differ: the varying-axes
            # check would refuse comparing them, though every device computes only its own rows.
            check_vma=False,
        )(q, k, v, segment_ids, index, sinks)

    return attend


def check_context(
    model: ModelConfig, layout: str, seq_len: int, length_axes: list[str], degree: int
) -> None:
    """Refuses a sequence length `layout` (compute.context_layout) cannot split over `degree`
    devices, a length rule (mesh.rules.length: `length_axes`) without the context axis, and the
    parts of a model that do not follow the split yet (the key/value exchanges are GQA's; linear
    attention's state runs along the whole sequence; multi-token prediction shifts targets along the
    array, which the balanced layout reorders)."""
    if degree > 1 and model.mla is not None:
        raise ConfigError(
            f"mesh.context={degree} splits grouped-query attention only, not model.mla's "
            "multi-head latent attention (set mesh.context=1)"
        )
    if degree > 1 and any(t.attention == "linear" for t in model.layer_types):
        raise ConfigError(
            f"mesh.context={degree} splits attention layers only: model.layers' linear "
            "layers (Gated DeltaNet) would need each device's chunk states passed along the "
            "context axis; set mesh.context=1 (fsdp, tensor and expert split them)"
        )
    if degree > 1 and model.mtp.depth:
        raise ConfigError(
            f"mesh.context={degree} does not split multi-token prediction yet; set "
            "model.mtp.depth=0 or mesh.context=1"
        )
    chunks = 2 * degree if layout == "balanced" else degree
    if degree > 1 and seq_len % chunks:
        raise ConfigError(
            f"train.seq_len={seq_len} must be divisible by {chunks} "
            f"(compute.context_layout={layout} over a context degree of "
            f"{degree})"
        )
    if degree > 1 and AXIS not in length_axes:
        raise ConfigError(
            f"mesh.context={degree} needs mesh.rules.length to include 'context' "
            f"(got {length_axes})"
        )
