"""Muon: momentum orthogonalised by Newton-Schulz iterations, for the weight matrices.

The published algorithm (K. Jordan, modded-nanogpt 2024; the update scale of Liu et al., "Muon
is Scalable for LLM Training", 2025), for a weight matrix W (m x n) with gradient G:

    B <- momentum * B + G
    U  = G + momentum * B                 (Nesterov; U = B without it)
    X  = U / ||U||_F, then ns_steps times X <- a X + (b A + c A^2) X with A = X X^T
    W <- W - lr * (rms_scale * sqrt(max(m, n)) * X + weight_decay * W)

The quintic (a, b, c) = (3.4445, -4.7750, 2.0315) drives every singular value of X toward ~1, so
X's entries have an RMS near 1/sqrt(max(m, n)); rms_scale * sqrt(max(m, n)) brings that to AdamW's
typical update RMS (0.2), so one optim.lr and schedule serve the matrices and the AdamW rest.

Which parameters are matrices (`matrix_dims`): every projection kernel in the layers, attention
q/k/v/o, the MLP's and each expert's. The embedding and the output head are not: a row of the
embedding is one token's vector and a column of the head one token's logit, updated only as the
token occurs, which is not the dense linear map Muon's spectral-norm step is derived for; both
methods' papers keep them on AdamW. The MoE router ([embed, experts], experts << embed) is kept on
AdamW too: orthogonalising it would give every expert's column an update of the same norm each
step, whatever its gradient, while the router's scale per expert is what balances their load.
Norm scales and biases are vectors: AdamW.

Stacked weights are orthogonalised matrix by matrix. Scanned layers carry a leading layers axis
([L, in, out]), experts an expert axis ([L, E, in, out]), pipelined ones stage axes in front; a
q kernel is [L, embed, heads, head_dim], one matrix embed x (heads * head_dim) per layer. Given
the parameters' shardings (the run's; `muon(..., shardings)`), a stacked parameter whose
matrices are split over devices (fsdp on `embed`, tensor on `mlp` or `heads`) has them dealt
out over those devices, each orthogonalising only its share, whole, between two all-to-alls
(optim/muon_deal.py); stacked axes split over devices (experts over `expert`, layers over
`stage`) stay split. Without shardings (one device, tools) every matrix is orthogonalised where
it is, with the same numerics. docs/optimizers.md quotes the bytes and the scratch.

Why not optax.contrib.muon as it stands (optax 0.2.8): its momentum is Adam-style, (1 - b)
weighted and bias-corrected with different corrections on the two Nesterov terms, which turns
the update's direction away from the published one from the second step on; and it folds every
batch axis into one with a reshape, which for [L, E, ...] with E sharded is not a tiling XLA can
keep, so it reshards the experts. Its Newton-Schulz helper is private, and is four lines.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from maxtrain.config import OptimConfig
from maxtrain.optim import muon_deal

# Kernels that stay on AdamW although they are matrices (see the module docstring).
NOT_MATRICES = ("lm_head", "router")


def matrix_dims(path: tuple) -> tuple[int, int] | None:
    """(input axes, output axes) of a parameter's trailing matrix, from its path in the params
    tree; None for a parameter AdamW updates. Axes before those are stacked (layers, experts,
    stages), one matrix each."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if len(names) < 2 or names[-1] != "kernel" or names[-2] in NOT_MATRICES:
        return None
    if names[-2] in ("q", "k", "v"):  # [embed, heads, head_dim]
        return 1, 2
    if names[-2] == "o":  # [heads, head_dim, embed]
        return 2, 1
    return 1, 1  # MLP and experts: [in, out]


def labels(params: Any) -> Any:
    """'muon' or 'adamw' per parameter: optax.partition's labels."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "adamw" if matrix_dims(path) is None else "muon", params
    )


def newton_schulz(x: jax.Array, coeffs: tuple[float, float, float], steps: int) -> jax.Array:
    """The quintic iteration on each trailing matrix of x (leading axes are a batch), from
    x / ||x||_F. It works on the wide side (A is min(m, n) square), transposing a tall matrix in
    and out: f(X^T) = f(X)^T. The barrier keeps the polynomial b A + c A^2 a min(m, n)-square
    matrix: left free, XLA distributes it over X (b A X + c A (A X)), and the TPU compiler then
    holds several more matrix-sized buffers per matrix than the two the memory estimate counts
    (tests/parallel/test_tpu_compile.py checks the two)."""
    a, b, c = coeffs
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        poly, x = jax.lax.optimization_barrier((b * gram + c * gram @ gram, x))
        x = a * x + poly @ x
    return x.mT if tall else x


def orthogonalize(
    u: jax.Array, dims: tuple[int, int], coeffs: tuple[float, float, float], steps: int
) -> jax.Array:
    """Newton-Schulz on every trailing matrix of u (dims = its input and output axes), scaled to
    AdamW's update RMS by sqrt(max(m, n)) (times rms_scale, applied by the caller)."""
    n_in, n_out = dims
    stacked, matrix = u.shape[: -(n_in + n_out)], u.shape[-(n_in + n_out) :]
    m, n = math.prod(matrix[:n_in]), math.prod(matrix[n_in:])
    x = newton_schulz(u.reshape(*stacked, m, n), coeffs, steps)
    return x.reshape(u.shape) * math.sqrt(max(m, n))


def one_after_another(fn: Any, *trees: Any) -> Any:
    """fn(path, *leaves) on every leaf of the trees, each call's inputs tied to the previous
    call's result by an optimization barrier: the parameters' Newton-Schulz working sets (and
    their Nesterov inputs) are live one at a time, so the scratch is the largest one's, not
    their sum, as XLA would otherwise be free to run them side by side."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(trees[0])
    rest = [treedef.flatten_up_to(t) for t in trees[1:]]
    out: list = []
    for i, (path, leaf) in enumerate(leaves):
        inputs = (leaf, *(r[i] for r in rest))
        if out:
            inputs, out[-1] = jax.lax.optimization_barrier((inputs, out[-1]))
        out.append(fn(path, *inputs))
    return jax.tree_util.tree_unflatten(treedef, out)


class MuonState(NamedTuple):
    momentum: Any  # B, one buffer per matrix


def scale_by_muon(
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_coeffs: tuple[float, float, float],
    shardings: Any = None,
) -> optax.GradientTransformation:
    """Updates -> the orthogonalised (Nesterov) momentum, sqrt(max(m, n))-scaled, per matrix.
    shardings: the parameters' NamedShardings (a tree like the params), to deal each one's
    matrices over the devices that share them (optim/muon_deal.py); None: orthogonalise in
    place."""
    by_path = {} if shardings is None else dict(jax.tree_util.tree_leaves_with_path(shardings))

    def init(params: Any) -> MuonState:
        return MuonState(jax.tree.map(jnp.zeros_like, params))

    def update(grads: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        buf = jax.tree.map(lambda b, g: momentum * b + g, state.momentum, grads)

        def matrix_update(path: tuple, b: jax.Array, g: jax.Array) -> jax.Array:
            u = g + momentum * b if nesterov else b
            dims = matrix_dims(path)
            ortho = functools.partial(orthogonalize, dims=dims, coeffs=ns_coeffs, steps=ns_steps)
            if path not in by_path:
                return ortho(u)
            return muon_deal.dealt(u, sum(dims), by_path[path], ortho)

        return one_after_another(matrix_update, buf, grads), MuonState(buf)

    return optax.GradientTransformation(init, update)


def muon(
    cfg: OptimConfig,
    lr: optax.Schedule,
    adamw: optax.GradientTransformation,
    shardings: Any = None,
) -> optax.GradientTransformation:
    """Muon on the matrices (optim.muon), `adamw` on every other parameter; shardings as
    scale_by_muon takes them."""
    m = cfg.muon
    matrices = optax.chain(
        scale_by_muon(m.momentum, m.nesterov, m.ns_steps, tuple(m.ns_coeffs), shardings),
        optax.scale(m.rms_scale),
        optax.add_decayed_weights(m.weight_decay),
        optax.scale_by_learning_rate(lr),
    )
    return optax.partition({"muon": matrices, "adamw": adamw}, labels)
