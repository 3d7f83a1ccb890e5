"""Reference models for the Hugging Face converters, with transformers as the oracle.

    python tools/make_hf_fixtures.py build [--output tests/fixtures/hf] [--case NAME ...]
    python tools/make_hf_fixtures.py logits DIR [DIR ...]
    python tools/make_hf_fixtures.py random-llama --output DIR [shape options]
    python tools/make_hf_fixtures.py generate DIR [DIR ...] [--max-new-tokens N]

build: for every case below, a small random transformers model saved as config.json +
safetensors, with token ids (tokens.npy, int32 [2, 12]) and the float32 logits transformers
computes for them (logits.npy) after loading the saved directory back, into <output>/<case>/.
The committed fixtures are its output; tests/hf/test_convert_hf.py compares our model's logits
with them. logits: the same oracle for any model directory holding a tokens.npy (the export
round-trip test uses it); it refuses a directory that loads with missing or unexpected tensors.

build and logits need torch and transformers, which maxtrain does not depend on; on the CPU dev
machines a CPU torch exists for Python 3.11 only, so they run in a separate environment:

    python3.11 -m venv scratch/hf311
    scratch/hf311/bin/pip install torch==2.13.0 transformers==5.23.0
    scratch/hf311/bin/python tools/make_hf_fixtures.py build

generate: the oracle for tokenization and greedy decoding. It gives a model directory a small
BPE tokenizer trained on a fixed text (tokenizer.json, tokenizer_config.json and
generation_config.json, as transformers saves them; a Llama directory's adds a BOS) unless it
has one, then writes generate.json: for each of a few prompts, the ids transformers' tokenizer
gives it and the tokens `generate()` appends greedily (--max-new-tokens, 12 by default; the
DeepSeek-V3 fixtures' are 20), one prompt at a time.

random-llama writes a Llama-shaped directory of random bfloat16 weights (Llama-3.2-1B's shape by
default) one layer per file, with numpy, safetensors and ml_dtypes only: the input for
measuring the converters' memory at real size.

This file imports nothing from maxtrain: it describes the Hugging Face side independently.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import numpy as np

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
TOKENS_SHAPE = (2, 12)
_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, max_position_embeddings=256)
_LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,  # small, so all three frequency bands occur at H=8
)

# DeepSeek-V3 shapes: multi-head latent attention with a value head size (12) unlike the
# query/key one (8 + 8), sigmoid routing with a correction bias, a shared expert, a first dense
# layer. YaRN with a small original context, so every band of the ramp occurs at 8 rotary dims.
_DEEPSEEK = dict(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
)
# DeepSeek-V3.2 shapes: DeepSeek-V3's, with a lightning indexer of 16 heads of 16 (its first 8
# dims rotated by halves, the attention's interleaved) choosing 4 keys per query, fewer than
# the 12 tokens, so the choice changes the logits.
_DEEPSEEK_V32 = dict(
    **{**_DEEPSEEK, "n_group": 1, "topk_group": 1},
    q_lora_rank=24,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
# GLM-4.5 shapes: grouped-query attention with q/k/v biases and partial RoPE, DeepSeek-V3's
# router (sigmoid scores, correction bias, shared expert), a first dense layer.
_GLM4_MOE = dict(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
)
_YARN = dict(
    rope_type="yarn",
    factor=8.0,  # = max_position_embeddings / original_max_position_embeddings
    original_max_position_embeddings=32,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

# GPT-OSS shapes: layers alternating a sliding window of 4 (< the 12 tokens) and full attention,
# 4 experts of which 2 per token, biases everywhere, attention sinks. The clamp's limit (0.8) is
# low enough that it clips many gate and up values; YaRN's ramp ends fall between frequency
# pairs at 8 dims (theta 100, original context 64), so its untruncated ramp (GPT-OSS's
# truncate: false) differs from the rounded one.
_GPT_OSS = dict(
    num_hidden_layers=3,
    num_attention_heads=6,  # 6 x 8 and 2 x 24 unlike the width 32: a transposition shows
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=24,
    swiglu_alpha=1.5,
    swiglu_limit=0.8,
    max_position_embeddings=512,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=100.0,
        factor=8.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)

# Qwen3-Next shapes: Gated DeltaNet layers 0-2 (2 query/key heads of 8, 4 value heads of 6:
# each key head's two value heads, value dims unlike key dims, so a misplaced head or group
# shows) and a gated attention layer 3 (4 heads of 8, 2 of them rotated: the default partial
# RoPE 0.25), as the default full_attention_interval 4 makes them; layer 0 dense
# (mlp_only_layers), the others MoE: 4 experts, 2 per token, a shared expert of twice an
# expert's width with its sigmoid gate.
_QWEN3_NEXT = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=16,
    mlp_only_layers=[0],
)
# Qwen3.5: Qwen3-Next's hybrid with separate Gated DeltaNet projections. Half of each 16-dim
# head rotated, with the multimodal RoPE keys published configs carry (text: plain RoPE).
_QWEN3_5 = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)
# Kimi Linear: three Kimi Delta Attention layers (4 heads of 8, a decay per key channel) then
# a NoPE multi-head latent attention layer, a dense first layer, then DeepSeek-V3's sigmoid
# router with a shared expert. Its default special token ids lie outside a small vocabulary.
_KIMI_LINEAR = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_attn_config=dict(head_dim=8, num_heads=4, short_conv_kernel_size=4),
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_experts=8,
    num_experts_per_token=2,
    moe_intermediate_size=16,
    num_shared_experts=1,
    first_k_dense_replace=1,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

# name -> (model_type, config keys, options). Options: layout "v5" keeps the config.json
# transformers 5 writes, "legacy" rewrites it the way most published checkpoints read;
# dtype: the stored weights (the oracle computes in float32 either way); head_dim_null: write
# head_dim as null; shard_bytes: save sharded with an index; seed: the case's random seed (default
# its position here; cases added side by side keep the seed they were committed with).
CASES: dict[str, tuple[str, dict, dict]] = {
    "llama_gqa_untied_sharded": (
        "llama",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        dict(layout="legacy", shard_bytes=40_000),
    ),
    "llama3_mqa_tied_rope_scaling": (
        "llama",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_theta=500000.0, **_LLAMA3_SCALING),
        ),
        dict(layout="legacy"),
    ),
    "llama_mha_rope_scaling_v5_bf16": (
        "llama",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_parameters=dict(rope_theta=10000.0, **_LLAMA3_SCALING),
        ),
        dict(layout="v5", dtype="bfloat16", head_dim_null=True),
    ),
    "qwen3_gqa_tied_head_dim16": (
        "qwen3",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # != 32 / 4
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dict(layout="legacy"),
    ),
    "qwen3_gqa4_untied_v5": (
        "qwen3",
        dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=8),
        dict(layout="v5"),
    ),
    "mixtral_top2_v5": (
        "mixtral",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
        ),
        dict(layout="v5"),
    ),
    "mixtral_top1_tied_legacy_bf16": (
        "mixtral",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size=32,
            tie_word_embeddings=True,
        ),
        dict(layout="legacy", dtype="bfloat16"),
    ),
    "qwen3_moe_top2_norm_topk_legacy": (
        "qwen3_moe",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        dict(layout="legacy"),
    ),
    "qwen3_moe_top3_sparse_step_v5": (
        "qwen3_moe",
        dict(
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[0, 1],  # MoE layers: 3 and 5
        ),
        dict(layout="v5"),
    ),
    "deepseek_v3_q_lora_yarn_v5": (
        "deepseek_v3",
        dict(**_DEEPSEEK, q_lora_rank=24, rope_parameters=dict(rope_theta=10000.0, **_YARN)),
        dict(layout="v5"),
    ),
    "deepseek_v3_plain_q_half_rope_legacy": (  # DeepSeek-V2-Lite's query; rotate-half pairing
        "deepseek_v3",
        dict(
            **{**_DEEPSEEK, "num_experts_per_tok": 3, "norm_topk_prob": False},
            q_lora_rank=None,
            rope_interleave=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        dict(layout="legacy"),
    ),
    # Group-limited routing: 4 groups of 2 experts, each token's experts from its best 2 groups.
    "deepseek_v3_grouped": (
        "deepseek_v3",
        dict(
            **{**_DEEPSEEK, "n_group": 4, "topk_group": 2},
            q_lora_rank=24,
            rope_parameters=dict(rope_theta=10000.0, **_YARN),
        ),
        dict(layout="legacy"),
    ),
    # GLM-4.5's options: qk-norm, routed_scaling_factor 2.5; a head wider than hidden / heads,
    # a quarter of it rotated (not GLM's half, so that the fraction is read, not assumed).
    "glm4_moe_qk_norm_quarter_rope_v5": (
        "glm4_moe",
        dict(
            **_GLM4_MOE,
            head_dim=16,
            use_qk_norm=True,
            routed_scaling_factor=2.5,
            rope_parameters=dict(rope_theta=1000000.0, partial_rotary_factor=0.25),
        ),
        dict(layout="v5"),
    ),
    # GLM-4.5-Air's: no qk-norm, half of each head rotated, partial_rotary_factor at top level
    # as the published config.json has it; routing within the best 2 of 4 groups.
    "glm4_moe_air_grouped_legacy": (
        "glm4_moe",
        dict(
            **_GLM4_MOE,
            n_group=4,
            topk_group=2,
            rope_parameters=dict(rope_theta=1000000.0, partial_rotary_factor=0.5),
        ),
        dict(layout="legacy"),
    ),
    # Llama 4: chunks of 4 positions on the RoPE layers (all but every 4th), a global NoPE layer
    # (3) whose queries' temperature grows from position 3 on (floor_scale 4), the unscaled
    # qk-norm; MoE every second layer (1, 3): top-1 sigmoid routing whose score scales the
    # expert's input, a shared expert, experts stored stacked; dense layers of their own width.
    "llama4_chunked_nope_moe_v5": (
        "llama4_text",
        dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=16,  # each expert's and the shared expert's
            intermediate_size_mlp=48,  # the dense layers'
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=4,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters=dict(rope_theta=500000.0, **_LLAMA3_SCALING),
        ),
        dict(layout="v5", seed=12),
    ),
    # Mistral: every layer's query sees itself and the 3 keys before it, fewer than the 12
    # tokens, so the window decides the logits; generate.json goes 16 tokens past it.
    "mistral_window4_v5": (
        "mistral",
        dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=4),
        dict(layout="v5", seed=14),
    ),
    "mistral_no_window_legacy": (
        "mistral",
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        ),
        dict(layout="legacy", seed=15),
    ),
    # Gemma 3: 5 sliding layers (window 4, shorter than the 12 tokens) : 1 global, the softmax
    # scale of query_pre_attn_scalar (12, not head_dim 8), linear RoPE scaling on the global
    # layer, a different base on the local ones; tied, as Gemma is.
    "gemma3_window4_linear_rope_v5": (
        "gemma3_text",
        dict(
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=12,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000.0),
                sliding_attention=dict(rope_type="default", rope_theta=10.0),
            ),
        ),
        dict(layout="v5", seed=14),
    ),
    # As published Gemma 3 configs read (sliding_window_pattern, rope_local_base_freq): every
    # third layer global over 5 layers (the pattern does not divide them), window 3, one
    # key/value head of 16 dims (!= 32 / 4), untied, bfloat16.
    "gemma3_period3_mqa_untied_legacy_bf16": (
        "gemma3_text",
        dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=3,
            sliding_window_pattern=3,
            query_pre_attn_scalar=24,
            tie_word_embeddings=False,
            rope_parameters=dict(
                full_attention=dict(rope_type="default", rope_theta=10000.0),
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
            ),
        ),
        dict(layout="legacy", dtype="bfloat16", seed=15),
    ),
    # GLM-5: the same shapes; its indexer's rotary dims paired interleaved.
    "glm_moe_dsa_indexer_top4_v5": ("glm_moe_dsa", _DEEPSEEK_V32, dict(layout="v5", seed=100)),
    "deepseek_v32_indexer_top4_v5": ("deepseek_v32", _DEEPSEEK_V32, dict(layout="v5", seed=100)),
    "gpt_oss_window_sinks_yarn_v5": ("gpt_oss", _GPT_OSS, dict(layout="v5", seed=2)),
    "qwen3_next_hybrid_moe_v5": ("qwen3_next", _QWEN3_NEXT, dict(layout="v5", seed=16)),
    "qwen3_5_text_tied_mrope_v5": (
        "qwen3_5_text",
        dict(_QWEN3_5, tie_word_embeddings=True),
        dict(layout="v5", seed=28),
    ),
    "kimi_linear_kda_nope_mla_v5": ("kimi_linear", _KIMI_LINEAR, dict(layout="v5", seed=19)),
    # Every layer MoE (Qwen3.5-MoE has no dense layer), a gated shared expert 2 experts wide.
    "qwen3_5_moe_text_v5": (
        "qwen3_5_moe_text",
        dict(
            _QWEN3_5,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
        ),
        dict(layout="v5", seed=24),
    ),
}


def build(output: Path, names: list[str]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for index, (name, (model_type, keys, options)) in enumerate(CASES.items()):
        if names and name not in names:
            continue
        seed = options.get("seed", index)
        torch.manual_seed(seed)
        config = AutoConfig.for_model(model_type, **{**_SMALL, **keys})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, torch)
        margins = _router_margins(model, torch)
        if options.get("dtype") == "bfloat16":
            model.to(torch.bfloat16)
        case_dir = output / name
        case_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(case_dir, max_shard_size=options.get("shard_bytes", 10**9))
        (case_dir / "generation_config.json").unlink(missing_ok=True)
        config_path = case_dir / "config.json"
        saved = json.loads(config_path.read_text())
        if options["layout"] == "legacy":
            saved = _legacy_layout(saved)
        if options.get("head_dim_null"):
            saved["head_dim"] = None
        config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        tokens = np.random.default_rng(seed).integers(0, config.vocab_size, TOKENS_SHAPE)
        np.save(case_dir / "tokens.npy", tokens.astype(np.int32))
        write_logits(case_dir)
        if margins is not None:
            tokens_t = torch.from_numpy(tokens.astype(np.int64))
            with torch.no_grad():
                model.eval()(input_ids=tokens_t)
            smallest = min(margins)
            if smallest < 1e-4:  # float32 rounding in either model: ~1e-6
                raise SystemExit(f"{name}: a router choice is within {smallest:.1e}; reseed")
            print(f"{name}: smallest router margin {smallest:.2e}")
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters")


def write_logits(model_dir: Path) -> None:
    """transformers' float32 logits for model_dir/tokens.npy, into model_dir/logits.npy."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"{model_dir}: transformers did not load it cleanly: {problems}")
    tokens = torch.from_numpy(np.load(model_dir / "tokens.npy").astype(np.int64))
    with torch.no_grad():
        logits = model.eval()(input_ids=tokens).logits
    np.save(model_dir / "logits.npy", logits.numpy().astype(np.float32))


# The tokenizer's training text and the prompts of generate.json (every character is in it).
_TOKENIZER_TEXT = (
    "the cat sat on the mat. a dog ran to the park, and the cat saw it. "
    "we write small models to test large ones; tokens go in and tokens come out. "
    "hello world, this is a tiny corpus for a tiny tokenizer with a tiny vocabulary."
)
PROMPTS = ("the cat sat", "hello world, this is a longer prompt for the model", "a")
MAX_NEW_TOKENS = 12
_SPECIALS = dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def write_tokenizer(model_dir: Path) -> None:
    """A BPE tokenizer (sentencepiece-style spaces) of the model's vocab size, its special
    tokens the first ids, and a generation config naming them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer(models.BPE(unk_token=_SPECIALS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=config["vocab_size"], special_tokens=list(_SPECIALS.values())
    )
    tokenizer.train_from_iterator([_TOKENIZER_TEXT], trainer)
    ids = {key: tokenizer.token_to_id(token) for key, token in _SPECIALS.items()}
    if config["model_type"] == "llama":  # Llama's tokenizer starts every text with BOS
        bos = (_SPECIALS["bos_token"], ids["bos_token"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **_SPECIALS}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    generation = {
        f"{k.removesuffix('_token')}_token_id": ids[k] for k in _SPECIALS if k != "unk_token"
    }
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_generation(model_dir: Path, max_new_tokens: int = MAX_NEW_TOKENS) -> None:
    """transformers' prompt ids and greedy continuations into model_dir/generate.json."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if not (model_dir / "tokenizer.json").is_file():
        write_tokenizer(model_dir)
    # The tokenizer tokenizer.json defines, as tokenizer_config.json names it: AutoTokenizer
    # would take the class transformers maps a model_type to (Qwen3.5-MoE's splits text its
    # own way before the BPE).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    margins: list[float] = []
    _indexer_margins(model, torch, margins)
    cases = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False
            )
        cases.append({"prompt": prompt, "prompt_ids": ids, "new_ids": out[0, len(ids) :].tolist()})
    if margins and min(margins) < 1e-4:  # an indexer's choice rounding could flip
        raise SystemExit(f"{model_dir}: an index score is within {min(margins):.1e}; reseed")
    result = {"max_new_tokens": max_new_tokens, "cases": cases}
    (model_dir / "generate.json").write_text(json.dumps(result, indent=1) + "\n")


def _randomize(model, torch) -> None:
    """Weights that make every mistake visible: matrices with std 1/sqrt(fan-in) (activations
    and logits of order 1, router scores well apart), norm scales around 1, not exactly 1."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def _router_margins(model, torch) -> list[float] | None:
    """Hooks that record, per router call, the smallest gap between a token's k-th and
    (k+1)-th selection score, so that rounding cannot flip a choice in our port: Llama 4's and
    GPT-OSS's (top-k of the logits) and DeepSeek-V3's and GLM-4.5's (the same router), whose
    correction biases (a buffer, not a parameter) are randomised first (its scores compared
    after group masking)."""
    margins: list[float] = []
    by_logits = {"Llama4Router": 1, "GptOssTopKRouter": 0}  # where its output holds the logits
    top_k_of_logits = [m for m in model.modules() if type(m).__name__ in by_logits]
    for router in top_k_of_logits:
        at = by_logits[type(router).__name__]
        router.register_forward_hook(
            lambda router, inputs, output, at=at: margins.append(
                _top_k_gap(output[at], router.top_k)
            )
        )
    _indexer_margins(model, torch, margins)
    kinds = (  # the same router
        "DeepseekV3TopkRouter",
        "Glm4MoeTopkRouter",
        "DeepseekV32TopkRouter",
        "GlmMoeDsaTopkRouter",
        "KimiLinearTopkRouter",
    )
    routers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not routers:
        return margins if top_k_of_logits or margins else None

    def record(router, inputs, output):
        _, _, chosen = output
        with torch.no_grad():
            x = inputs[0].reshape(-1, router.hidden_dim).float()
            select = (x @ router.weight.float().T).sigmoid() + router.e_score_correction_bias
            group_scores = select.view(len(select), router.num_group, -1).topk(2, -1)[0].sum(-1)
            ranked = group_scores.sort(-1, descending=True)[0]
            kept = group_scores >= ranked[:, router.topk_group - 1 : router.topk_group]
            per_group = router.num_experts // router.num_group
            select = select.masked_fill(~kept.repeat_interleave(per_group, 1), float("-inf"))
            picked = select.gather(1, chosen)
            rest = select.scatter(1, chosen, float("-inf"))
            gap = picked.min(-1)[0] - rest.max(-1)[0]
            if router.topk_group < router.num_group:
                k = router.topk_group
                gap = torch.minimum(gap, ranked[:, k - 1] - ranked[:, k])
            margins.append(float(gap.min()))

    for router in routers:
        with torch.no_grad():
            bias = router.e_score_correction_bias
            bias.copy_(0.1 * torch.randn_like(bias))
        router.register_forward_hook(record)
    return margins


def _indexer_margins(model, torch, margins: list[float]) -> None:
    """DeepSeek sparse attention's indexers (DeepseekV32Indexer and its subclasses): while one
    runs, its top-k call records the smallest gap between a query's k-th and (k+1)-th index
    score, among queries with more than k visible keys (the masked ones are at finfo.min or
    -inf), so that rounding cannot change a choice in our port."""
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    if not indexers:
        return
    running: list[bool] = []
    topk = torch.Tensor.topk

    def recording_topk(scores, k, *args, **kwargs):
        if running and k < scores.shape[-1]:
            ranked = scores.detach().float().sort(-1, descending=True)[0]
            choice = (ranked[..., k] > -1e30) & (ranked[..., k - 1] > -1e30)
            if choice.any():
                margins.append(float((ranked[..., k - 1] - ranked[..., k])[choice].min()))
        return topk(scores, k, *args, **kwargs)

    def enter(*_) -> None:
        running.append(True)

    def leave(*_) -> None:  # a hook's return value would replace the output
        running.pop()

    torch.Tensor.topk = recording_topk
    for indexer in indexers:
        indexer.register_forward_pre_hook(enter)
        indexer.register_forward_hook(leave)


def _top_k_gap(scores, k: int) -> float:
    """The smallest gap, over rows of scores [n, E], between the k-th and (k+1)-th largest."""
    ranked = scores.detach().float().sort(-1, descending=True)[0]
    return float((ranked[:, k - 1] - ranked[:, k]).min())


def _legacy_layout(cfg: dict) -> dict:
    """transformers 5's config.json rewritten as transformers 4 wrote it: rope_theta and
    rope_scaling at top level (GLM-4.5's partial_rotary_factor too), torch_dtype, Qwen3-MoE's
    num_experts, and Gemma 3's sliding_window_pattern and rope_local_base_freq (no
    layer_types)."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    if cfg["model_type"] == "gemma3_text":
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = dict(rope["full_attention"])
        cfg["sliding_window_pattern"] = cfg.pop("_sliding_window_pattern")
        del cfg["layer_types"]
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    return cfg


def random_llama(output: Path, args: argparse.Namespace) -> None:
    """A Llama directory of random bfloat16 weights, one safetensors file per layer."""
    import ml_dtypes
    from safetensors.numpy import save_file

    D, F, H = args.hidden_size, args.intermediate_size, args.hidden_size // args.heads
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)

    def norm() -> np.ndarray:
        return np.ones(D, ml_dtypes.bfloat16)

    def layer(i: int) -> dict[str, np.ndarray]:
        p = f"model.layers.{i}."
        return {
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": weight(args.heads * H, D),
            p + "self_attn.k_proj.weight": weight(args.kv_heads * H, D),
            p + "self_attn.v_proj.weight": weight(args.kv_heads * H, D),
            p + "self_attn.o_proj.weight": weight(D, args.heads * H),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": weight(F, D),
            p + "mlp.up_proj.weight": weight(F, D),
            p + "mlp.down_proj.weight": weight(D, F),
        }

    def final() -> dict[str, np.ndarray]:
        head = {} if args.tie else {"lm_head.weight": weight(args.vocab_size, D)}
        return {"model.norm.weight": norm(), **head}

    plan = [
        (
            "model-embed.safetensors",
            lambda: {"model.embed_tokens.weight": weight(args.vocab_size, D)},
        )
    ]
    plan += [
        (f"model-layer{i:03d}.safetensors", functools.partial(layer, i)) for i in range(args.layers)
    ]
    plan += [("model-final.safetensors", final)]
    output.mkdir(parents=True)
    weight_map, total = {}, 0
    for file, make in plan:  # one file's tensors in memory at a time
        tensors = make()
        save_file(tensors, output / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": H,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            **_LLAMA3_SCALING,
            "factor": 32.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": args.tie,
        "torch_dtype": "bfloat16",
    }
    (output / "config.json").write_text(json.dumps(config, indent=2))
    count = total // 2
    print(f"wrote {output}: {count:,} parameters ({total / 2**30:.2f} GiB bfloat16)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the fixtures")
    b.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    b.add_argument("--case", action="append", default=[], choices=CASES)
    lg = sub.add_parser("logits", help="transformers' logits for DIR/tokens.npy")
    lg.add_argument("dirs", nargs="+", type=Path)
    r = sub.add_parser("random-llama", help="a random Llama directory (default: 3.2-1B shape)")
    r.add_argument("--output", type=Path, required=True)
    r.add_argument("--vocab-size", type=int, default=128256)
    r.add_argument("--hidden-size", type=int, default=2048)
    r.add_argument("--intermediate-size", type=int, default=8192)
    r.add_argument("--layers", type=int, default=16)
    r.add_argument("--heads", type=int, default=32)
    r.add_argument("--kv-heads", type=int, default=8)
    r.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True)
    g = sub.add_parser("generate", help="a tokenizer and transformers' greedy tokens for DIR")
    g.add_argument("dirs", nargs="+", type=Path)
    g.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args(argv)
    if args.command == "generate":
        for d in args.dirs:
            write_generation(d, args.max_new_tokens)
    elif args.command == "build":
        build(args.output, args.case)
    elif args.command == "logits":
        for d in args.dirs:
            write_logits(d)
    else:
        random_llama(args.output, args)


if __name__ == "__main__":
    main(sys.argv[1:])
