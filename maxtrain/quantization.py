"""Quantized training (QT) from the config's `quantization:` section, with no layer code touched.

`qwix.quantize_model` gives the model a subclass whose `__call__` runs under Qwix's
interception: while the model runs, `jnp.einsum`, `jax.lax.dot_general` and the experts'
grouped matmul (`jax.lax.ragged_dot` on its xla path, `tokamax.ragged_dot` on GPU/TPU) become
quantize -> matmul -> rescale, with straight-through gradients, as the first rule whose regex
matches the calling module's path says. Only the graph definition changes. The parameters stay
the same float arrays, so the train state, checkpoints, resume and starting from a float
checkpoint are exactly those of a float run, and the model FLOPs (hence MFU) are counted the
same way.

Paths are the module attribute paths joined by '/': `layers/attn/q`, `layers/mlp/down`,
`moe_layers/moe` (router einsum and experts' ragged_dot), `moe_layers/moe/shared/up`, `lm_head`,
and '' for the decoder itself (the tied-embedding logits).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import qwix
import tokamax
from flax import nnx

from maxtrain.config import ConfigError, QuantizationConfig, QuantRule
from maxtrain.kernels.quantized_grouped_matmul import GroupedMatmulQuant, quantized_ragged_dot

# The presets quantize every projection and the routed experts. They leave alone the attention
# core (scores and weighted values: both operands are activations, and softmax inputs are
# precision-sensitive), the router (a flipped top-k changes the computation, not just its
# precision) and the logits, as is usual for int8/fp8 training recipes.
_PROJECTIONS = r".*attn/(q|k|v|o)|.*(mlp|shared)/(gate|up|down)"
_EXPERTS = r"(.*/)?moe"


def _preset(weight: str | None, act: str | None, bwd: str | None) -> tuple[QuantRule, ...]:
    qtypes = dict(weight_qtype=weight, act_qtype=act, bwd_qtype=bwd)
    return (
        QuantRule(module_path=_PROJECTIONS, **qtypes),
        QuantRule(module_path=_EXPERTS, op_names=["ragged_dot"], **qtypes),
    )


PRESETS: dict[str, tuple[QuantRule, ...]] = {
    "none": (),
    "int8": _preset("int8", "int8", "int8"),
    # e4m3 (more mantissa) forward, e5m2 (more range) for gradients: the usual fp8 recipe.
    "fp8": _preset("float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"),
    # Weight-only int4, activations in compute dtype: trains the model to be served that way.
    "w4a16-serving": _preset("int4", None, None),
}


def rules(qcfg: QuantizationConfig) -> tuple[QuantRule, ...]:
    """The rules in precedence order: the config's own first, then the preset's."""
    return (*qcfg.rules, *PRESETS[qcfg.preset])


def module_paths(model: nnx.Module) -> dict[str, nnx.Module]:
    """Path (as rules see it) -> module, for every module of the model."""
    return {"/".join(map(str, path)): module for path, module in nnx.iter_modules(model)}


def quantize(model: nnx.Module, qcfg: QuantizationConfig) -> nnx.Module:
    """The model with quantized matmuls per the config (the model itself if nothing applies).

    Works on an abstract model (ShapeDtypeStruct leaves): no forward pass is run here, since
    dynamic-range QT creates no variables. Raises ConfigError for a rule of the config whose
    module_path matches no module.
    """
    active = rules(qcfg)
    if not active:
        return model
    paths = module_paths(model)
    for i, rule in enumerate(qcfg.rules):
        if not any(_fullmatch(rule.module_path, p) for p in paths):
            raise ConfigError(
                f"quantization.rules[{i}].module_path {rule.module_path!r} matches no module; "
                f"modules: {', '.join(sorted(p for p in paths if p))}"
            )
    provider = _QtProvider([_qwix_rule(r) for r in active])
    # skip_nnx_init: the first call only creates variables (static-range statistics, LoRA
    # weights), none of which dynamic-range QT has; so the model may stay abstract.
    return qwix.quantize_model(model, provider, None, skip_nnx_init=True)


class _QtProvider(qwix.QtProvider):
    """Qwix's QT provider, extended to the experts' grouped matmul on both of its paths.

    On the xla path Qwix intercepts `jax.lax.ragged_dot` itself. On GPU/TPU the experts call
    `tokamax.ragged_dot`, which this provider intercepts too and sends to
    kernels/quantized_grouped_matmul.py: the quantized operands go to tokamax's kernel, with a
    straight-through backward.

    Either way the experts run per device (layers/moe.py): the tokens vary over the
    data-parallel mesh axes while the gathered weights do not. A plain ragged_dot lets jax mark
    the weights varying implicitly, and the transpose of that mark sums their gradient over
    those axes. A quantized ragged_dot is a custom_vjp, whose backward must return a gradient
    of its input's type, so the mark is made here, before it: the gradient comes back varying
    and the explicit pcast's transpose sums it, as in the float model.

    Qwix's quantized ragged_dot also needs both operands quantized; a weight-only rule
    (w4a16-serving) on the xla path is handled here by fake-quantizing the weights, per expert
    and output channel as Qwix would, with a straight-through gradient.
    """

    def get_intercept_map(self):
        return super().get_intercept_map() | {"tokamax.ragged_dot": self.tokamax_ragged_dot}

    def ragged_dot(self, lhs, rhs, group_sizes, *args, **kwargs):
        rule, _ = self._get_current_rule_and_op_id("ragged_dot", only_rule=True)
        if rule is not None and rule.weight_qtype is not None and rule.act_qtype is None:
            q = qwix.quantize(
                rhs,
                rule.weight_qtype,
                channelwise_axes=(0, 2),
                calibration_method=rule.weight_calibration_method,
            )
            rhs = rhs + jax.lax.stop_gradient(qwix.dequantize(q) - rhs)
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)
        return super().ragged_dot(*_same_varying_axes(lhs, rhs), group_sizes, *args, **kwargs)

    def tokamax_ragged_dot(self, lhs, rhs, group_sizes, *, preferred_element_type=None):
        rule, _ = self._get_current_rule_and_op_id("ragged_dot", only_rule=True)
        if rule is None or rule.weight_qtype is None:
            return tokamax.ragged_dot(
                lhs, rhs, group_sizes, preferred_element_type=preferred_element_type
            )
        quant = GroupedMatmulQuant(
            weight_qtype=rule.weight_qtype,
            act_qtype=rule.act_qtype,
            bwd_qtype=rule.bwd_qtype,
            weight_calibration=rule.weight_calibration_method,
            act_calibration=rule.act_calibration_method,
        )
        lhs, rhs = _same_varying_axes(lhs, rhs)
        return quantized_ragged_dot(lhs, rhs, group_sizes, quant, preferred_element_type)


def _same_varying_axes(lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """lhs and rhs marked varying over the union of the manual mesh axes either varies over."""
    lhs_axes = jax.typeof(lhs).manual_axis_type.varying
    rhs_axes = jax.typeof(rhs).manual_axis_type.varying
    if rhs_axes - lhs_axes:
        lhs = jax.lax.pcast(lhs, tuple(rhs_axes - lhs_axes), to="varying")
    if lhs_axes - rhs_axes:
        rhs = jax.lax.pcast(rhs, tuple(lhs_axes - rhs_axes), to="varying")
    return lhs, rhs


def _fullmatch(pattern: str, path: str) -> bool:
    return re.fullmatch(pattern, path) is not None


def _qwix_rule(rule: QuantRule) -> qwix.QtRule:
    return qwix.QtRule(
        module_path=rule.module_path,
        op_names=tuple(rule.op_names),
        weight_qtype=rule.weight_qtype,
        act_qtype=rule.act_qtype,
        bwd_qtype=rule.bwd_qtype,
        tile_size=rule.tile_size,
        weight_calibration_method=rule.weight_calibration,
        act_calibration_method=rule.act_calibration,
    )


# Primitives that do a matmul's work (ragged_dot lowers to ragged_dot_general).
_MATMULS = frozenset({"dot_general", "ragged_dot_general", "ragged_dot"})


def matmul_dtypes(fn: Callable[..., Any], *args: Any) -> collections.Counter:
    """How often each (primitive, operand dtypes) matmul occurs in fn's traced program,
    nested programs (scan, remat, shard_map, custom_vjp) included: what actually multiplies.

    A Pallas kernel (tokamax's attention and grouped matmul on GPU/TPU) counts as one entry,
    `pallas_call <kernel name>`, with the dtypes of its first two matrix operands: what the
    kernel is handed, e.g. int8 weights for the quantized grouped matmul. Its body is not
    searched, since how a kernel multiplies inside is its own business (H100's quantized
    grouped matmul scales its int8 weights to bf16 in registers).
    """
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr: jax.extend.core.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _MATMULS:
                dtypes = tuple(str(v.aval.dtype) for v in eqn.invars[:2])
                counts[(eqn.primitive.name, dtypes)] += 1
            elif eqn.primitive.name == "pallas_call":
                matrices = [v for v in eqn.invars if getattr(v.aval, "ndim", 0) >= 2]
                dtypes = tuple(str(v.aval.dtype) for v in matrices[:2])
                counts[(f"pallas_call {eqn.params.get('name')}", dtypes)] += 1
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


# ---- post-training quantization of a parameter tree (tools/quantize.py) ----------------------
#
# Weights are quantized directly, array by array, rather than through Qwix's PtqProvider: the
# provider quantizes only what its interception sees, and it does not intercept ragged_dot, so
# the experts' stacked kernels (most of an MoE model's weights) would stay float.

# Logical axes that index whole matmuls (stacked layers, experts), never contracted.
_STACK_AXES = ("layers", "exp")


def contraction_axes(axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """Which axes of a kernel its matmul sums over, from the kernel's logical axes.

    Kernels that write the embedding (attention o, MLP/expert down) read everything else;
    every other kernel (q/k/v, gate/up, lm_head) reads the embedding. A scale is kept per
    element of the remaining axes: per output channel, per layer and per expert.
    """
    if axes[-1] == "embed":
        return tuple(i for i, a in enumerate(axes[:-1]) if a not in _STACK_AXES)
    return tuple(i for i, a in enumerate(axes) if a == "embed")


def quantizable_kernels(abstract_state: nnx.State) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Path in the params dict -> contraction axes, for every matmul kernel PTQ quantizes.

    The router stays float (a flipped top-k is a different computation, not a less precise
    one), as do the embedding table (a lookup, and the tied logits' weights) and norm scales.
    """
    kernels = {}
    for path, var in nnx.to_flat_state(abstract_state):
        names = tuple(str(p) for p in path)
        if names[-1] != "kernel" or "router" in names:
            continue
        axes = var.get_metadata().get("out_sharding")
        kernels[names] = contraction_axes(tuple(axes))
    return kernels


def quantize_params(
    params: dict, kernels: dict[tuple[str, ...], tuple[int, ...]], qtype: str
) -> tuple[dict, dict[str, list[float]]]:
    """Returns (params with each kernel replaced by {qvalue, scale}, relative L2 error of each
    dequantized kernel per stacked layer: the per-layer error report). Symmetric absmax."""
    out = jax.tree.map(lambda x: x, params)
    errors = {}
    for path, reduce_axes in kernels.items():
        node = out
        for key in path[:-1]:
            node = node[key]
        w = node[path[-1]]
        keep = tuple(i for i in range(w.ndim) if i not in reduce_axes)
        q = qwix.quantize(w, qtype, channelwise_axes=keep)
        node[path[-1]] = {"qvalue": q.qvalue, "scale": q.scale}
        # Stacked kernels (leading layer axis) get one error per layer; lm_head a single one.
        rows = w.shape[0] if path[0] in ("layers", "moe_layers") else 1
        diff = (qwix.dequantize(q) - w).reshape(rows, -1)
        relative = jnp.linalg.norm(diff, axis=1) / jnp.linalg.norm(w.reshape(rows, -1), axis=1)
        errors["/".join(path)] = [float(e) for e in relative]
    return out, errors


def dequantize_params(qparams: dict) -> dict:
    """The float params a quantized tree stands for (qvalue x scale, broadcast)."""

    def is_quantized(node) -> bool:
        return isinstance(node, dict) and set(node) == {"qvalue", "scale"}

    return jax.tree.map(
        lambda n: n["qvalue"].astype(n["scale"].dtype) * n["scale"] if is_quantized(n) else n,
        qparams,
        is_leaf=is_quantized,
    )
