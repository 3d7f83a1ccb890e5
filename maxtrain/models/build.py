"""Model assembly: build a decoder from config and count its parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxtrain.config import LoraConfig, ModelConfig
from maxtrain.models.decoder import Decoder, PipelinedDecoder
from maxtrain.models.pipeline import StageLayout
from maxtrain.models.stacks import is_moe_per_layer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    """'auto' is bfloat16 on accelerators and float32 on CPU (where bf16 is emulated, slowly)."""
    if cfg.compute_dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return _DTYPES[cfg.compute_dtype]


def build(
    cfg: ModelConfig,
    seed: int = 0,
    layout: StageLayout | None = None,
    lora: LoraConfig | None = None,
) -> Decoder:
    """A freshly initialised model (call under jit to get sharded parameters, see state.py);
    with a layout, the pipelined model (whose parameters come from the plain one's, never from
    its own initialisation: models/pipeline.py to_stages); with lora.rank > 0, with low-rank
    adapters (maxtrain/lora.py), created after the model so that it initialises the same."""
    kwargs = dict(
        param_dtype=_DTYPES[cfg.param_dtype],
        compute_dtype=compute_dtype(cfg),
        rngs=nnx.Rngs(params=seed),
    )
    model = Decoder(cfg, **kwargs) if layout is None else PipelinedDecoder(cfg, layout, **kwargs)
    if lora is not None and lora.enabled:
        from maxtrain import lora as lora_lib  # Qwix takes seconds to import: only when asked

        lora_lib.add_adapters(model, lora, seed)
    return model


def abstract(
    cfg: ModelConfig, layout: StageLayout | None = None, lora: LoraConfig | None = None
) -> Decoder:
    """The model with ShapeDtypeStruct leaves: shapes and metadata, no memory."""
    return nnx.eval_shape(lambda: build(cfg, layout=layout, lora=lora))


def param_count(cfg: ModelConfig) -> int:
    """Total parameters of the model this config builds (embedding and head included)."""
    state = nnx.state(abstract(cfg), nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(state))


def adapter_count(cfg: ModelConfig, lora: LoraConfig) -> int:
    """The low-rank adapters' parameters (maxtrain/lora.py): what a LoRA run trains."""
    state = nnx.state(abstract(cfg, lora=lora), nnx.LoRAParam)
    return sum(int(x.size) for x in jax.tree.leaves(state))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: the total less the experts it was not routed to."""
    idle = 0
    if cfg.moe is not None:
        m = cfg.moe
        kinds = is_moe_per_layer(cfg)
        mtp_moe_blocks = cfg.mtp.depth if kinds[-1] else 0  # models/mtp.py: last layer's kind
        idle = (
            (sum(kinds) + mtp_moe_blocks)
            * (m.num_experts - m.top_k)
            * 3
            * cfg.emb_dim
            * m.expert_mlp_dim
        )
    return param_count(cfg) - idle
