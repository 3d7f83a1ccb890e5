"""Model assembly: build a decoder from config and count its parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import ComputeConfig, ConfigError, ModelConfig, named_tiles
from maxtrain.kernels.attention import attention_implementation
from maxtrain.kernels.grouped_matmul import grouped_matmul_implementation, tile_problem
from maxtrain.layers.spec import DTYPES, ModelSpec, compute_dtype_name
from maxtrain.models.decoder import Decoder
from maxtrain.models.pipelined import PipelinedDecoder
from maxtrain.models.stacks import is_moe_per_layer
from maxtrain.parallel.expert_exchanges import exchange_implementation

if TYPE_CHECKING:  # parallel/pipeline.py imports the models package: no cycle at run time
    from maxtrain.parallel.pipeline import StageLayout


def compute_dtype(compute: ComputeConfig) -> jnp.dtype:
    """compute.compute_dtype on this process's default backend ('auto': bfloat16 on
    accelerators, float32 on CPU); `platform_choices` makes the choice for other devices."""
    return DTYPES[compute_dtype_name(compute.compute_dtype)]


def platform_choices(
    compute: ComputeConfig,
    model: ModelConfig,
    platform: str,
    device_kind: str = "",
    chips_per_slice: int = 1,
) -> ComputeConfig:
    """`compute:` with every choice that depends on the hardware made for `platform` ("cpu",
    "gpu", "tpu") and, where it matters, the device kind and slice size: the attention kernel,
    the grouped matmul, the expert-parallel exchange and the compute dtype, each "auto" (or
    "mosaic") replaced by what it means there, and checked against `model`.

    The platform is that of the devices the program is built for, which need not be the
    process's: a CPU host compiles for compile-only TPU devices (maxtrain/parallel/topology.py).
    Made once, where the mesh is known (training/run_model.py for_platform), so that every
    layer, check and estimate downstream reads a concrete choice and none asks
    `jax.default_backend()`.
    """
    attention = attention_implementation(compute.attention, platform)
    if compute.attention_max_logit and attention != "xla":
        raise ConfigError(
            f"optim.qk_clip_threshold (compute.attention_max_logit) needs each attention head's "
            f"max logit, which only compute.attention=xla computes; compute.attention="
            f"{compute.attention} is {attention} on {platform}"
        )
    grouped_matmul = grouped_matmul_implementation(compute.grouped_matmul, platform)
    if model.moe is not None and grouped_matmul == "tokamax":
        _check_tiles(named_tiles(compute.grouped_matmul_tiles), platform)
    return compute.model_copy(
        update={
            "attention": attention,
            "compute_dtype": compute_dtype_name(compute.compute_dtype, platform),
            "grouped_matmul": grouped_matmul,
            "expert_exchange": exchange_implementation(
                compute.expert_exchange, platform, device_kind, chips_per_slice
            ),
        }
    )


def _check_tiles(tiles: dict, platform: str) -> None:
    """Tiles named for tokamax's kernels must be those of `platform`'s kernel: known when the
    devices are, here, not when the config is read."""
    for projection, per_pass in tiles.items():
        if problem := tile_problem(per_pass, platform):
            raise ConfigError(f"compute.grouped_matmul_tiles.{projection}.{problem}")


def build(spec: ModelSpec, seed: int = 0, layout: StageLayout | None = None) -> Decoder:
    """A freshly initialised model (call under jit to get sharded parameters, see
    training/state.py); with a layout, the pipelined model (whose parameters come from the
    plain one's, never from its own initialisation: parallel/pipeline.py to_stages)."""
    rngs = nnx.Rngs(params=seed)
    if layout is None:
        return Decoder(spec, rngs=rngs)
    return PipelinedDecoder(spec, layout, rngs=rngs)


def abstract(spec: ModelSpec, layout: StageLayout | None = None) -> Decoder:
    """The model with ShapeDtypeStruct leaves: shapes and metadata, no memory."""
    return nnx.eval_shape(lambda: build(spec, layout=layout))


def param_count(cfg: ModelConfig) -> int:
    """Total parameters of the model this config builds (embedding and head included)."""
    state = nnx.state(abstract(ModelSpec(cfg)), nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(state))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: the total less the experts it was not routed to."""
    idle = 0
    if cfg.moe is not None:
        m = cfg.moe
        kinds = is_moe_per_layer(cfg)
        mtp_moe_blocks = cfg.mtp.depth if kinds[-1] else 0  # models/mtp.py: last layer's kind
        expert = 3 * cfg.emb_dim * m.expert_mlp_dim
        if m.expert_projection_bias:  # gate, up and down biases
            expert += 2 * m.expert_mlp_dim + cfg.emb_dim
        idle = (sum(kinds) + mtp_moe_blocks) * (m.num_experts - m.top_k) * expert
    return param_count(cfg) - idle


def embedding_lookup_params(cfg: ModelConfig) -> int:
    """The input embedding's parameters where only a lookup reads them (untied: a tied one is
    the head's matmul too). Published active counts differ on them: OpenAI's gpt-oss and
    DeepSeek-V3 count active parameters without them, Mistral and Qwen with them."""
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.emb_dim
