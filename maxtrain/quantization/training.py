"""Quantized training (QT) from the config's `quantization:` section, with no layer code touched.

`qwix.quantize_model` gives the model a subclass whose `__call__` runs under Qwix's
interception: while the model runs, `jnp.einsum`, `jax.lax.dot_general` and the experts'
grouped matmul (`jax.lax.ragged_dot` on its xla path, `tokamax.ragged_dot` on GPU/TPU) become
quantize -> matmul -> rescale, with straight-through gradients, as the first rule whose regex
matches the calling module's path says. Only the graph definition changes. The parameters stay
the same float arrays, so the train state, checkpoints, resume and starting from a float
checkpoint are exactly those of a float run, and the model FLOPs (hence MFU) are counted the
same way.

Paths are the module attribute paths joined by '/': `layers/attn/q` (multi-head latent
attention: `layers/attn/kv_b`, ...), `layers/mlp/down`,
`moe_layers/moe` (router einsum and experts' ragged_dot), `moe_layers/moe/shared/up`, `lm_head`,
and '' for the decoder itself (the tied-embedding logits).
"""

from __future__ import annotations

import re

import jax
import qwix
import tokamax
from flax import nnx

from maxtrain.config import ConfigError, QuantizationConfig, QuantRule
from maxtrain.kernels.quantized_grouped_matmul import GroupedMatmulQuant, quantized_ragged_dot

# The presets quantize every projection and the routed experts. They leave alone the attention
# core (scores and weighted values: both operands are activations, and softmax inputs are
# precision-sensitive), the router (a flipped top-k changes the computation, not just its
# precision) and the logits, as is usual for int8/fp8 training recipes.
# (Multi-head latent attention's projections: q or q_a/q_b, kv_a, kv_b, o.)
_PROJECTIONS = r".*attn/(q|k|v|o|q_a|q_b|kv_a|kv_b)|.*(mlp|shared)/(gate|up|down)"
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
    # skip_nnx_init: the first call only creates variables (static-range statistics, adapter
    # weights), none of which dynamic-range QT has; so the model may stay abstract.
    return qwix.quantize_model(model, provider, None, skip_nnx_init=True)


class _QtProvider(qwix.QtProvider):
    """Qwix's QT provider, extended to the experts' grouped matmul on both of its paths.

    On the xla path Qwix intercepts `jax.lax.ragged_dot` itself. On GPU/TPU the experts call
    `tokamax.ragged_dot`, which this provider intercepts too and sends to
    kernels/quantized_grouped_matmul.py: the quantized operands go to tokamax's kernel, with a
    straight-through backward.

    Either way the experts run per device (parallel/experts.py): the tokens vary over the
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

    def tokamax_ragged_dot(
        self, lhs, rhs, group_sizes, *, preferred_element_type=None, manual_axis_type=None
    ):
        rule, _ = self._get_current_rule_and_op_id("ragged_dot", only_rule=True)
        if rule is None or rule.weight_qtype is None:
            return tokamax.ragged_dot(
                lhs,
                rhs,
                group_sizes,
                preferred_element_type=preferred_element_type,
                manual_axis_type=manual_axis_type,
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
