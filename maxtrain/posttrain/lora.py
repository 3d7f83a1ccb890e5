"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen base model, and QLoRA (Dettmers et al.
2023): the base's layer kernels stored quantized.

An adapted matmul computes y = x W + (alpha / rank) (x A) B, with W frozen, A [inputs, rank]
random and B [rank, outputs] zero at the start, so the adapted model starts as the base model.

Qwix's LoRA provider computes the projections' adapter path while the model runs: it intercepts
each adapted module's einsum and adds (x A) B. Qwix would create A and B during the model's
first call, but maxtrain's layers run from one stacked parameter tree (models/decoder.py), where
a module created inside the layer scan cannot keep a variable. So `add_adapters` creates them
beforehand, stacked like the kernels they adapt, under the names Qwix looks up
(`kernel_lora_a`, `kernel_lora_b`): Qwix then finds them on every layer's module and only
computes. The routed experts run a grouped matmul, which Qwix's LoRA provider does not intercept:
their adapters are added to the expert weights before the experts run (layers/moe.py
ExpertKernel.weight), which computes the same function; its backward forms each layer's expert
weight gradient before projecting it onto A and B.

The train state keeps the two apart (training/state.py): `params` holds only the adapters, which the
optimizer and the checkpoints see; `frozen` holds the base, read from
checkpoint.load_parameters_path at every start and resume and never saved. With
lora.base_quantization set, the base's layer kernels are stored as Qwix QArrays and dequantized
one layer at a time inside the layer loop (models/decoder.py run_stack). `merge` folds the
adapters into the base: a plain model, for export, generation and evaluation.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from maxtrain import models as model_lib
from maxtrain.common.units import count
from maxtrain.config import Config, ConfigError, LoraConfig, ModelConfig
from maxtrain.layers.base import ADAPTER_A, ADAPTER_B, Projection
from maxtrain.layers.moe import ExpertKernel
from maxtrain.models.stacks import STACKS, STAGES

A, B = ADAPTER_A, ADAPTER_B  # the names Qwix's provider looks up beside `kernel`
# The logical axis of the adapters' rank dim (mesh.rules; by default split over fsdp): where
# the other dim of A or B is not split over fsdp (B of q, A of o, ...), the rank dim is, so
# that every adapter is divided over the devices like the weight it adapts.
RANK_AXIS = "lora_rank"

# Module paths (attribute names joined by '/') of the matmuls each lora.modules entry adapts.
_MODULES = {
    "attention": r"(.*/)?attn/(q|k|v|o|q_a|q_b|kv_a|kv_b)",
    "mlp": r"(.*/)?(mlp|shared)/(gate|up|down)",
    "experts": r"(.*/)?moe/(gate|up|down)",
}


def adapted_modules(model: nnx.Module, lcfg: LoraConfig) -> dict[str, nnx.Module]:
    """Path -> module, for every module lora.modules adapts."""
    pattern = "|".join(_MODULES[m] for m in lcfg.modules)
    found = {}
    for path, module in nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if isinstance(module, Projection | ExpertKernel) and re.fullmatch(pattern, name):
            found[name] = module
    return found


def add_adapters(model: nnx.Module, lcfg: LoraConfig, seed: int) -> nnx.Module:
    """Gives every adapted module its A (random) and B (zero), stacked like its kernel: the
    kernel's leading stack axes (layers, stages) come first, then the matmul's own shape. They
    are float32 whatever compute.param_dtype (which the frozen base keeps: bfloat16 halves it),
    so that the optimizer's small updates are not lost to rounding."""
    modules = adapted_modules(model, lcfg)
    if not modules:
        raise ConfigError(
            f"lora.modules={lcfg.modules} matches no matmul of this model (mlp: the dense "
            "layers' and shared experts' SwiGLU; experts: the routed experts); name one it has"
        )
    for path, module in modules.items():
        a_shape, a_axes, b_shape, b_axes, fan_in = _adapter_layout(module, lcfg.rank)
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))
        bound = math.sqrt(6.0 / fan_in)  # He-uniform, as Qwix initialises A
        a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
        setattr(module, A, nnx.LoRAParam(a, out_sharding=a_axes, eager_sharding=False))
        b = jnp.zeros(b_shape, jnp.float32)
        setattr(module, B, nnx.LoRAParam(b, out_sharding=b_axes, eager_sharding=False))
        if isinstance(module, ExpertKernel):
            module.adapter_scale = lcfg.scale
    return model


def _adapter_layout(module: nnx.Module, rank: int):
    """(A's shape, A's logical axes, B's shape, B's logical axes, A's fan-in) of a module.

    A projection `btd,dnh->btnh` (kernel [d, n, h]) gets A [d, r] and B [r, n, h], the shapes
    Qwix's provider derives from the einsum; the experts' [E, in, out] kernels get A
    [E, in, r] and B [E, r, out]. Leading stack axes of the kernel are prepended to both.
    """
    shape = module.kernel.shape
    axes = tuple(module.kernel.get_metadata().get("out_sharding") or (None,) * len(shape))
    if isinstance(module, ExpertKernel):
        lead = len(shape) - 3
        batch, contract, keep = [lead], [lead + 1], [lead + 2]
    else:
        inputs, weights = module.spec.split("->")[0].split(",")
        lead = len(shape) - len(weights)
        batch = []
        contract = [lead + i for i, c in enumerate(weights) if c in inputs]
        keep = [lead + i for i, c in enumerate(weights) if c not in inputs]
    if contract and keep and max(contract) > min(keep):  # merge() relies on this order
        raise ValueError(f"a kernel with outputs before inputs: {module.spec}")
    stack = list(range(lead))

    def pick(dims):
        return tuple(shape[i] for i in dims), tuple(axes[i] for i in dims)

    (a_shape, a_axes), (b_shape, b_axes) = pick(stack + batch + contract), pick(stack + batch)
    keep_shape, keep_axes = pick(keep)
    a_shape, a_axes = (*a_shape, rank), (*a_axes, RANK_AXIS)
    b_shape, b_axes = (*b_shape, rank, *keep_shape), (*b_axes, RANK_AXIS, *keep_axes)
    fan_in = math.prod(shape[i] for i in contract)
    return a_shape, a_axes, b_shape, b_axes, fan_in


def with_lora(model: nnx.Module, lcfg: LoraConfig) -> nnx.Module:
    """The model (which has its adapters: add_adapters) with Qwix's provider adding (x A) B
    to its adapted projections. Works on an abstract model: the provider creates nothing."""
    paths = [p for p, m in adapted_modules(model, lcfg).items() if isinstance(m, Projection)]
    if not paths:  # experts only: they apply their adapters themselves
        return model
    rule = qwix.LoraRule(
        module_path="|".join(re.escape(p) for p in paths), rank=lcfg.rank, alpha=lcfg.alpha
    )
    return qwix.quantize_model(model, qwix.LoraProvider([rule]), skip_nnx_init=True)


# ---- the two halves of the parameters ---------------------------------------------------------


def is_adapter(path: tuple) -> bool:
    return str(path[-1]) in (A, B)


def split(params: dict) -> tuple[dict, dict]:
    """A params dict with adapters -> (the adapters, the base), each a nested dict."""
    adapters, base = {}, {}
    for path, leaf in _flat(params):
        _put(adapters if is_adapter(path) else base, path, leaf)
    return adapters, base


def combine(base: Any, adapters: dict) -> dict:
    """The params the model runs on: the base with the adapters added beside their kernels.
    base None (no adapters in this run): the params are all trained, and given as `adapters`."""
    if base is None:
        return adapters
    out = jax.tree.map(lambda x: x, base, is_leaf=qwix.QArray.__instancecheck__)
    for path, leaf in _flat(adapters):
        _put(out, path, leaf)
    return out


def _flat(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _put(tree: dict, path: tuple, leaf: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = leaf


# ---- QLoRA: the base's layer kernels quantized --------------------------------------------------


def quantized_kernels(params: dict, abstract_state: nnx.State, lcfg: LoraConfig) -> dict:
    """The base params with every layer kernel lora.modules adapts stored as a Qwix QArray
    (lora.base_quantization): absmax scales per layer, per output channel and per block of
    lora.block_size inputs along the last input axis."""
    out = jax.tree.map(lambda x: x, params)
    for path, var in nnx.to_flat_state(abstract_state):
        names = tuple(str(p) for p in path)
        if names[-1] != "kernel" or names[0] not in _LAYER_STACKS:
            continue
        if not re.fullmatch("|".join(_MODULES[m] for m in lcfg.modules), "/".join(names[:-1])):
            continue
        axes = tuple(var.get_metadata().get("out_sharding"))
        node = out
        for key in names[:-1]:
            node = node[key]
        node["kernel"] = quantize_kernel(node["kernel"], axes, lcfg)
    return out


# Run by models/decoder.py run_stack, which dequantizes; pipelined, the stacks are in STAGES.
_LAYER_STACKS = (*STACKS.values(), STAGES)


def quantize_kernel(kernel: jax.Array, axes: tuple, lcfg: LoraConfig) -> qwix.QArray:
    """One stacked kernel as a QArray. Its input axes are those PTQ reduces over
    (quantization/ptq.py contraction_axes); every other axis keeps a scale per element."""
    from maxtrain.quantization.ptq import contraction_axes

    inputs = contraction_axes(axes)
    last = inputs[-1]
    tiled = {last: lcfg.block_size} if kernel.shape[last] % lcfg.block_size == 0 else {}
    keep = tuple(i for i in range(kernel.ndim) if i not in inputs)
    return qwix.quantize(
        kernel, lcfg.base_quantization, channelwise_axes=keep, tiled_axes=tiled or None
    )


def dequantized(params: Any) -> Any:
    """A whole params tree with its QArrays multiplied out (for merging and export)."""
    is_q = lambda x: isinstance(x, qwix.QArray)  # noqa: E731
    return jax.tree.map(lambda x: qwix.dequantize(x) if is_q(x) else x, params, is_leaf=is_q)


# ---- merging ----------------------------------------------------------------------------------


def merge(params: dict, lcfg: LoraConfig, abstract_state: nnx.State) -> dict:
    """A params dict with adapters (combine's output) -> the plain model's params: each adapted
    kernel W becomes W + (alpha / rank) A B, in W's dtype; a quantized kernel is first
    dequantized (the function the adapters were trained with)."""
    adapters, base = split(dequantized(params))
    flat_axes = {
        tuple(str(p) for p in path[:-1]): tuple(var.get_metadata().get("out_sharding") or ())
        for path, var in nnx.to_flat_state(abstract_state)
        if str(path[-1]) == "kernel"
    }
    merged = jax.tree.map(lambda x: x, base)
    for path, a in _flat(adapters):
        if path[-1] != A:
            continue
        module_path = path[:-1]
        b = _get(adapters, (*module_path, B))
        node = _get(merged, module_path)
        w = node["kernel"]
        delta = _product(a, b, w.shape, flat_axes[tuple(map(str, module_path))])
        node["kernel"] = (w.astype(jnp.float32) + lcfg.scale * delta).astype(w.dtype)
    return merged


def _product(a: jax.Array, b: jax.Array, kernel_shape: tuple, axes: tuple) -> jax.Array:
    """A B in the kernel's layout, float32: A [..., in..., r], B [..., r, out...]; the experts'
    kernels ([..., E, in, out]) have E on both."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if "exp" in axes:
        return jnp.einsum("...ir,...ro->...io", a, b)
    lead = a.ndim + b.ndim - 2 - len(kernel_shape)  # stack axes, on A, B and the kernel
    a = a.reshape(*a.shape[:lead], -1, a.shape[-1])  # [..., inputs, r]
    b = b.reshape(*b.shape[: lead + 1], -1)  # [..., r, outputs]
    return jnp.einsum("...ir,...ro->...io", a, b).reshape(kernel_shape)


def _get(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# ---- the parameter split (training/split.py) ------------------------------------------------


class LoraSplit:
    """The adapters train; the base they sit on is frozen (its adapted layer kernels stored
    quantized under lora.base_quantization), read from checkpoint.load_parameters_path."""

    adds_parameters = True
    loads_trained = False
    has_frozen = True

    def __init__(self, lcfg: LoraConfig):
        self.lcfg = lcfg

    def adapt(self, module: nnx.Module, seed: int) -> None:
        add_adapters(module, self.lcfg, seed)

    def wrap(self, module: nnx.Module) -> nnx.Module:
        return with_lora(module, self.lcfg)

    def split(self, params: dict) -> tuple[dict, dict]:
        return split(params)

    def combine(self, trained: dict, frozen: Any) -> dict:
        return combine(frozen, trained)

    def stored(self, frozen: dict, abstract_state: nnx.State) -> dict:
        if self.lcfg.base_quantization == "none":
            return frozen
        return quantized_kernels(frozen, abstract_state, self.lcfg)

    def start(self, trained: dict, frozen: Any) -> dict:
        """The base under zero adapters: the model the run started from, nothing stored."""
        return combine(frozen, jax.tree.map(jnp.zeros_like, trained))

    def describe(self, cfg: Config) -> str:
        lcfg = self.lcfg
        stored = "" if lcfg.base_quantization == "none" else f", stored {lcfg.base_quantization}"
        return (
            f"{count(adapter_count(cfg.model, lcfg))} of them trained (LoRA rank {lcfg.rank} on "
            f"{', '.join(lcfg.modules)}; base {cfg.checkpoint.load_parameters_path}{stored}), "
        )


def adapter_count(model_cfg: ModelConfig, lcfg: LoraConfig) -> int:
    """The adapters' parameters: what a LoRA run trains."""

    def adapted() -> nnx.Module:
        return add_adapters(model_lib.build(model_lib.ModelSpec(model_cfg), 0), lcfg, 0)

    state = nnx.state(nnx.eval_shape(adapted), nnx.LoRAParam)
    return sum(int(x.size) for x in jax.tree.leaves(state))
