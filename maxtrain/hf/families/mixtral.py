"""Mixtral (MixtralForCausalLM): Llama's attention, every layer a mixture of experts
(`block_sparse_moe`, experts w1/w3/w2). transformers takes the softmax over all experts, keeps
the top k and always divides by their sum; its "softmax over the top-k logits" is the same
number: model.moe's softmax mode, renormalised."""

from maxtrain.hf.attention import GroupedQuery
from maxtrain.hf.family import TRANSFORMERS_DEFAULTS, Family
from maxtrain.hf.feed_forward import DenseMlp, Experts
from maxtrain.hf.layer_layout import AllGlobal, AllMoe, LayerLayout

FAMILY = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    defaults={
        **TRANSFORMERS_DEFAULTS,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 1e-3,
    },
    required={"hidden_act": "silu", "sliding_window": None},
    layers=LayerLayout(AllGlobal(), AllMoe()),
    aspects=(
        GroupedQuery(),
        DenseMlp(),
        Experts(
            count_keys=("num_local_experts",),
            width_key="intermediate_size",
            block="block_sparse_moe",
            names=("w1", "w3", "w2"),
        ),
    ),
    claims=lambda cfg: cfg.moe is not None,
    rank=1,
)
