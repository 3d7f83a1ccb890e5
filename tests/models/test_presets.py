"""Model presets in configs/models/: published shapes give published parameter counts.

Each preset's parameter count is computed two independent ways and both are checked:

* closed form from the preset's shape keys (``closed_form_params`` below), which catches a typo
  in a preset file (a wrong width, a missed ``tie_embeddings``) against the published count;
* ``maxtrain.models.param_count``, which counts the parameters of the model the code actually
  builds, which catches a model bug (a missing norm, a head that ignores tying, a wrong
  projection shape) against the closed form, exactly.

Presets are loaded through ``maxtrain.config.load`` so the base.yml <- model file <- run file
merge is exercised too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from maxtrain.config import CONFIGS_DIR, ModelConfig, load, preset

MODELS_DIR = CONFIGS_DIR / "models"

# Published total parameter counts: (preset, count, relative tolerance, source).
# A tolerance of 0 means the source gives the exact integer.
PUBLISHED = [
    # keras-hub preset llama3_8b_en metadata "params" (keras_hub/src/models/llama3/
    # llama3_presets.py); HF safetensors metadata of meta-llama/Meta-Llama-3-8B: 8.03B.
    ("llama3-8b", 8_030_261_248, 0.0),
    # HF safetensors metadata parameter count of meta-llama/Meta-Llama-3-70B: 70.6B.
    ("llama3-70b", 70_553_706_496, 0.0),
    # HF safetensors metadata parameter count of meta-llama/Llama-3.2-1B (1.24B on the hub
    # page; also the constant in GPTQModel/tests/test_parameter_count.py). Meta card: 1.23B.
    ("llama3.2-1b", 1_235_814_400, 0.0),
    # keras-hub preset qwen3_0.6b_en metadata "params" (keras_hub/src/models/qwen3/
    # qwen3_presets.py). Qwen3-0.6B model card: 0.6B total, 0.44B non-embedding.
    ("qwen3-0.6b", 596_049_920, 0.0),
    # HF safetensors metadata of mistralai/Mistral-7B-v0.1: 7.24B (rounded to 0.01B). The
    # sliding window (layers [sliding-dense]) adds no parameter.
    ("mistral-7b", 7_241_732_096, 0.001),
    # Kanana report (arXiv 2502.18934) and model name: 2.1B, no exact integer published. The
    # single bf16 model.safetensors of kakaocorp/kanana-nano-2.1b-base is 4.17 GB -> 2.085e9
    # parameters (an untied head would make it 2.32e9).
    ("kanana-nano-2.1b", 2_085_000_000, 0.005),
    # Kanana report (arXiv 2502.18934) and the HF "Kanana-1.5" collection
    # (kakaocorp/kanana-1.5-8b-base): 8B, no exact integer published. A weak check: the preset's
    # widths are assumed (Llama-3-8B's), see the header of configs/models/kanana-8b.yml.
    ("kanana-8b", 8_000_000_000, 0.005),
    # keras-hub preset gemma3_1b metadata "params" (keras_hub/src/models/gemma3/
    # gemma3_presets.py); Gemma 3 report (arXiv 2503.19786) table 1: 302M + 698M.
    ("gemma3-1b", 999_885_952, 0.0),
    # The language model alone, as the dry-run counts it: keras-hub preset gemma3_27b_text's
    # 27,009,002,240 (a 262,144-row table) plus the 64 more rows (x 5376) of the HF
    # checkpoint's 262,208-row table that the preset keeps. Not HF's 27.4B: that adds the
    # SigLIP vision encoder (417M in the report's table 1) and the image projector.
    ("gemma3-27b", 27_009_002_240 + 64 * 5376, 0.0),
]

# Non-embedding counts stated separately by a model card: (preset, count, tolerance, source).
PUBLISHED_NON_EMBEDDING = [
    ("qwen3-0.6b", 440_000_000, 0.005),  # Qwen3-0.6B model card: "Non-Embedding: 0.44B"
]

# Presets that are not published models: their designed counts, so an edit shows up here.
DESIGNED = [
    ("dense-1.5b", 1_498_482_688),
    ("small", 1_049_728),
    ("tiny", 106_816),
    ("tiny-qk", 115_136),
]

ALL_PRESETS = sorted({name for name, *_ in PUBLISHED} | {name for name, _ in DESIGNED})
MLA_PRESETS = [
    "deepseek-v3-671b", "kimi-k2-1t", "deepseek-v2-lite-16b", "tiny-mla", "deepseek-v3.2-671b",
    "glm-5",
]  # fmt: skip
GQA_MOE_PRESETS = ["glm-4.5", "glm-4.5-air"]
LLAMA4_PRESETS = ["llama4-scout-17b-16e"]
GPT_OSS_PRESETS = ["gpt-oss-120b", "gpt-oss-20b"]


def closed_form_params(m: ModelConfig) -> int:
    """Parameters of a pre-norm (or sandwich-norm) decoder with GQA attention and a gated MLP,
    no biases."""
    d, hd = m.emb_dim, m.resolved_head_dim
    attention = (
        d * m.num_heads * hd  # q
        + d * m.resolved_kv_heads * hd  # k
        + d * m.resolved_kv_heads * hd  # v
        + m.num_heads * hd * d  # o
    )
    mlp = 3 * d * m.mlp_dim  # gate, up, down
    norms = 2 * d  # pre-attention and pre-MLP RMSNorm scales
    if m.block_norms == "sandwich":
        norms += 2 * d  # and the scales of the attention's and the MLP's output norms
    if m.qk_norm == "rms":
        norms += 2 * hd  # q-norm and k-norm scales, shared across heads
    embedding = m.vocab_size * d
    head = 0 if m.tie_embeddings else m.vocab_size * d
    return embedding + m.num_layers * (attention + mlp + norms) + d + head  # + final norm


def load_preset(name: str, tmp_path: Path) -> ModelConfig:
    run_file = tmp_path / "run.yml"
    run_file.write_text(f"model_name: {name}\n")
    return load(run_file).model


def model_params(m: ModelConfig) -> int:
    from maxtrain.models import param_count

    return param_count(m)


def assert_close(got: int, want: int, rel_tol: float, what: str) -> None:
    if rel_tol == 0:
        assert got == want, f"{what}: {got:,} != published {want:,}"
    else:
        err = abs(got - want) / want
        assert err <= rel_tol, (
            f"{what}: {got:,} is {err:.3%} from published {want:,} (tolerance {rel_tol:.1%})"
        )


@pytest.mark.parametrize(("name", "published", "rel_tol"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_param_count(name: str, published: int, rel_tol: float, tmp_path: Path) -> None:
    m = load_preset(name, tmp_path)
    assert_close(closed_form_params(m), published, rel_tol, f"{name} closed form")
    assert_close(model_params(m), published, rel_tol, f"{name} model")


@pytest.mark.parametrize(
    ("name", "published", "rel_tol"),
    PUBLISHED_NON_EMBEDDING,
    ids=[p[0] for p in PUBLISHED_NON_EMBEDDING],
)
def test_published_non_embedding_count(
    name: str, published: int, rel_tol: float, tmp_path: Path
) -> None:
    m = load_preset(name, tmp_path)
    assert m.tie_embeddings  # otherwise the head would count as non-embedding
    non_embedding = closed_form_params(m) - m.vocab_size * m.emb_dim
    assert_close(non_embedding, published, rel_tol, f"{name} non-embedding")


@pytest.mark.parametrize(("name", "designed"), DESIGNED, ids=[d[0] for d in DESIGNED])
def test_designed_param_count(name: str, designed: int, tmp_path: Path) -> None:
    assert closed_form_params(load_preset(name, tmp_path)) == designed


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_model_matches_closed_form(name: str, tmp_path: Path) -> None:
    m = load_preset(name, tmp_path)
    assert model_params(m) == closed_form_params(m)


@pytest.mark.parametrize(
    "name", ALL_PRESETS + MLA_PRESETS + GQA_MOE_PRESETS + LLAMA4_PRESETS + GPT_OSS_PRESETS
)
def test_load_keeps_preset_shape(name: str, tmp_path: Path) -> None:
    """base.yml must not override a shape key that the model file sets."""
    preset = yaml.safe_load((MODELS_DIR / f"{name}.yml").read_text())
    loaded = load_preset(name, tmp_path).model_dump()
    for key, value in preset.items():
        got = as_given(loaded[key], value)
        assert got == value, f"{name}: model.{key} = {got!r}, file has {value!r}"


def as_given(loaded, given):
    """`loaded` cut to the keys `given` sets, at every depth (others take defaults)."""
    if not isinstance(given, dict):
        return loaded
    return {k: as_given(loaded[k], v) for k, v in given.items()}


@pytest.mark.parametrize("path", sorted(MODELS_DIR.glob("*.yml")), ids=lambda p: p.stem)
def test_model_file_holds_only_shape_keys(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("#"), f"{path.name}: no header comment naming the source"
    data = yaml.safe_load(text)
    assert isinstance(data, dict) and "model" not in data, f"{path.name}: not bare model keys"
    ModelConfig.model_validate(data)  # every key known (the model's alone), every value valid


def restated_defaults(given: dict, section: BaseModel, prefix: str = "") -> list[str]:
    """The keys of `given` (a model file's, or a section of it) whose value, as validated into
    `section`, is the schema's default for that key."""
    found = []
    for key, value in given.items():
        field, validated = type(section).model_fields[key], getattr(section, key)
        if isinstance(value, dict) and isinstance(validated, BaseModel):
            found += restated_defaults(value, validated, f"{prefix}{key}.")
        if not field.is_required() and validated == field.get_default(call_default_factory=True):
            found.append(f"{prefix}{key}")
    return found


@pytest.mark.parametrize("path", sorted(MODELS_DIR.glob("*.yml")), ids=lambda p: p.stem)
def test_no_preset_key_restates_a_schema_default(path: Path) -> None:
    """A model file sets what makes its model differ from the schema's defaults, nothing else:
    a default said twice is a default that can drift (the fact a restated key's comment
    carried belongs to the key that stays or the file's header)."""
    given = yaml.safe_load(path.read_text())
    assert restated_defaults(given, preset(path.stem)) == []


def test_a_restated_default_is_found() -> None:
    """The walk above, on keys that restate defaults at each depth it looks."""
    given = {"norm_eps": 1e-5, "rope": {"theta": 10000.0}, "mtp": {"depth": 2, "loss_weight": 0.3}}
    shape = dict(vocab_size=8, emb_dim=4, num_layers=1, num_heads=2, mlp_dim=8)
    model = ModelConfig.model_validate({**shape, **given})
    assert restated_defaults(given, model) == ["norm_eps", "rope.theta", "rope", "mtp.loss_weight"]


def test_closed_form_counts_what_it_should() -> None:
    """The formula itself, on a shape small enough to count by hand."""
    m = ModelConfig(
        vocab_size=10, emb_dim=4, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=6
    )  # head_dim 2: q 16, k 8, v 8, o 16, mlp 72, norms 8 -> layer 128
    assert closed_form_params(m) == 40 + 128 + 4 + 40  # embedding, layer, final norm, head
    tied_qk = m.model_copy(update={"tie_embeddings": True, "qk_norm": "rms", "head_dim": 3})
    # head_dim 3: q 24, k 12, v 12, o 24, mlp 72, norms 8 + 6 -> layer 158
    assert closed_form_params(tied_qk) == 40 + 158 + 4


# ---- DeepSeek-style presets (multi-head latent attention, MoE) --------------------------------


def mla_moe_closed_form(m: ModelConfig) -> tuple[int, int]:
    """(total, one MoE layer's) parameters of a DeepSeek-V3-shaped model, from its shape keys:
    multi-head latent attention, dense first layers, routed + shared SwiGLU experts."""
    a, e, d = m.mla, m.moe, m.emb_dim
    qk, heads = a.qk_nope_head_dim + a.qk_rope_head_dim, m.num_heads
    q = d * heads * qk if a.q_lora_rank is None else a.q_lora_rank * (d + heads * qk + 1)
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank  # kv_a and its norm
    kv += a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)  # kv_b
    attention = q + kv + heads * a.v_head_dim * d + 2 * d  # o, the two block norms
    if (i := a.indexer) is not None:  # its q, k and its LayerNorm, head weights
        attention += a.q_lora_rank * i.heads * i.head_dim + d * i.head_dim + 2 * i.head_dim
        attention += d * i.heads
    router = d * e.num_experts + (e.num_experts if e.balance_bias_update_rate > 0 else 0)
    moe_layer = attention + router + (e.num_experts + e.shared_experts) * 3 * d * e.expert_mlp_dim
    dense_layer = attention + 3 * d * m.mlp_dim
    dense = dense_layers(m)
    layers = dense * dense_layer + (m.num_layers - dense) * moe_layer
    return 2 * m.vocab_size * d + layers + d, moe_layer


def dense_layers(m: ModelConfig) -> int:
    """How many of the model's layers are dense."""
    return sum(not m.is_moe_layer(i) for i in range(m.num_layers))


# (preset, published total, published active, published total with one multi-token prediction
# module or None, relative tolerance of the totals, of the active count). Active counts are
# what a token multiplies against (the input embedding is a lookup): published rounded to whole
# billions (DeepSeek-V3 "37B" +-1.35%), so their tolerance is wider.
PUBLISHED_MLA = [
    # DeepSeek-V3 technical report (arXiv 2412.19437) and its model card: 671B total, 37B
    # activated per token; 685B with the multi-token prediction module on the hub.
    ("deepseek-v3-671b", 671e9, 37e9, 685e9, 0.01, 0.015),
    # Kimi K2 technical report (arXiv 2507.20534): 1.04T total (with its multi-token prediction
    # layer; the released checkpoint without it holds 1.026T), 32B activated.
    ("kimi-k2-1t", 1.026e12, 32e9, 1.04e12, 0.01, 0.015),
    # DeepSeek-V2 report (arXiv 2405.04434), appendix: V2-Lite 15.7B total, 2.4B activated.
    ("deepseek-v2-lite-16b", 15.7e9, 2.4e9, None, 0.01, 0.025),
    # DeepSeek-V3.2-Exp's model card: DeepSeek-V3's 671B/37B and 685B on the hub, its indexers
    # (0.85B) within the rounding.
    ("deepseek-v3.2-671b", 671e9, 37e9, 685e9, 0.01, 0.015),
    # GLM-5 technical report: 744B total, 40B activated (without its multi-token prediction
    # layer).
    ("glm-5", 744e9, 40e9, None, 0.01, 0.025),
]


@pytest.mark.parametrize("case", PUBLISHED_MLA, ids=[p[0] for p in PUBLISHED_MLA])
def test_mla_presets_match_published_counts(case, tmp_path: Path) -> None:
    from maxtrain.models import active_param_count

    name, total, active, with_mtp, rel_tol, active_tol = case
    m = load_preset(name, tmp_path)
    closed, moe_layer = mla_moe_closed_form(m)
    assert model_params(m) == closed
    assert_close(closed, int(total), rel_tol, f"{name} total")
    assert_close(active_param_count(m) - m.vocab_size * m.emb_dim, int(active), active_tol, name)
    if with_mtp is not None:
        # One MTP module: a MoE layer, its [2D -> D] projection and three norms; it shares
        # the embedding and the head.
        mtp = moe_layer + 2 * m.emb_dim * m.emb_dim + 3 * m.emb_dim
        assert_close(closed + mtp, int(with_mtp), rel_tol, f"{name} with MTP")


def test_tiny_mla_designed_count(tmp_path: Path) -> None:
    m = load_preset("tiny-mla", tmp_path)
    assert model_params(m) == mla_moe_closed_form(m)[0] == 901_296


# ---- GLM-4.5 presets (grouped-query attention with biases, MoE) -------------------------------


def gqa_moe_closed_form(m: ModelConfig) -> tuple[int, int]:
    """(total, one MoE layer's) parameters of a GLM-4.5-shaped model, from its shape keys:
    grouped-query attention with q/k/v biases and optional qk-norm, dense first layers, routed
    + shared SwiGLU experts behind a router with its correction bias, an untied head."""
    e, d, hd = m.moe, m.emb_dim, m.resolved_head_dim
    q, kv = m.num_heads * hd, m.resolved_kv_heads * hd
    attention = 2 * d * q + 2 * d * kv + 2 * d  # q and o, k and v, the two block norms
    attention += (q + 2 * kv) * (m.attention_projection_bias != "none")
    attention += 2 * hd * (m.qk_norm == "rms")
    router = d * e.num_experts + e.num_experts
    moe_layer = attention + router + (e.num_experts + e.shared_experts) * 3 * d * e.expert_mlp_dim
    dense_layer = attention + 3 * d * m.mlp_dim
    dense = dense_layers(m)
    layers = dense * dense_layer + (m.num_layers - dense) * moe_layer
    return 2 * m.vocab_size * d + layers + d, moe_layer


# (preset, published total, published active, relative tolerance of the total, of the active
# count). GLM-4.5's report (arXiv 2508.06471) and model cards give totals and activated
# counts rounded to whole billions, without the multi-token prediction layer (GLM-4.5-Air's
# total with it would be 109.2B, 3% over) and with activated counts that leave out the
# embedding and the output head (32.08B and 12.18B; with the head, 32.86B and 12.80B would not
# round to 32B and 12B). "12B" covers +-4%, hence the wider active tolerance.
PUBLISHED_GQA_MOE = [
    ("glm-4.5", 355e9, 32e9, 0.01, 0.015),
    ("glm-4.5-air", 106e9, 12e9, 0.01, 0.025),
]


@pytest.mark.parametrize("case", PUBLISHED_GQA_MOE, ids=[p[0] for p in PUBLISHED_GQA_MOE])
def test_gqa_moe_presets_match_published_counts(case, tmp_path: Path) -> None:
    from maxtrain.models import active_param_count

    name, total, active, rel_tol, active_tol = case
    m = load_preset(name, tmp_path)
    closed, moe_layer = gqa_moe_closed_form(m)
    assert model_params(m) == closed
    assert_close(closed, int(total), rel_tol, f"{name} total")
    embedding_and_head = 2 * m.vocab_size * m.emb_dim
    assert_close(active_param_count(m) - embedding_and_head, int(active), active_tol, name)
    # One MTP module (model.mtp.depth 1, left out of the published total): a MoE layer, its
    # [2D -> D] projection and three norms.
    with_mtp = m.model_copy(update={"mtp": m.mtp.model_copy(update={"depth": 1})})
    assert model_params(with_mtp) - closed == moe_layer + 2 * m.emb_dim**2 + 3 * m.emb_dim


# ---- Llama 4 (chunked RoPE layers, NoPE layers, a shared expert beside routed ones) ----------


def llama4_closed_form(m: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of a Llama-4-shaped model, from its shape keys: grouped-query
    attention (its qk-norm has no scale), model.layers' moe layers routed and shared SwiGLU
    experts with a router, the others a dense SwiGLU of mlp_dim; embedding and head untied."""
    d, e = m.emb_dim, m.moe
    hd = m.resolved_head_dim
    attention = 2 * d * m.num_heads * hd + 2 * d * m.resolved_kv_heads * hd + 2 * d  # + norms
    expert = 3 * d * e.expert_mlp_dim
    moe_layers = m.num_layers - dense_layers(m)
    moe_layer = attention + d * e.num_experts + (e.num_experts + e.shared_experts) * expert
    dense_layer = attention + 3 * d * (m.mlp_dim or 0)
    total = (
        2 * m.vocab_size * d
        + d
        + moe_layers * moe_layer
        + (m.num_layers - moe_layers) * dense_layer
    )
    return total, total - moe_layers * (e.num_experts - e.top_k) * expert


# (preset, published total, published active, relative tolerance). Active counts include the
# embedding and the head, as Meta's (and Mistral's for Mixtral) do.
PUBLISHED_LLAMA4 = [
    # Llama 4 model card (meta-llama/Llama-4-Scout-17B-16E): 17B active, 109B total. The total
    # is the multimodal checkpoint's: the vision encoder and projector of its vision_config
    # (34 layers of width 1408 and MLP 5632 with biases, patch 14 at 336 px, the pixel-shuffle
    # adapter, a 4096 -> 5120 projector) add 0.87B to this text model's 107.77B (-1.1% from
    # 109B); the 17B is the text model's (17.17B here).
    ("llama4-scout-17b-16e", 109e9, 17e9, 0.015),
]


@pytest.mark.parametrize("case", PUBLISHED_LLAMA4, ids=[p[0] for p in PUBLISHED_LLAMA4])
def test_llama4_presets_match_published_counts(case, tmp_path: Path) -> None:
    from maxtrain.models import active_param_count

    name, total, active, rel_tol = case
    m = load_preset(name, tmp_path)
    closed_total, closed_active = llama4_closed_form(m)
    assert (model_params(m), active_param_count(m)) == (closed_total, closed_active)
    assert_close(closed_total, int(total), rel_tol, f"{name} total")
    assert_close(closed_active, int(active), rel_tol, f"{name} active")


# ---- GPT-OSS presets (attention sinks, biases, MoE with biased experts) ----------------------


def gpt_oss_closed_form(m: ModelConfig) -> int:
    """Parameters of a GPT-OSS-shaped model from its shape keys: grouped-query attention with
    q/k/v/o biases and a sink per head, every layer a mixture of experts whose router and
    experts (gate, up, down) carry biases."""
    d, hd, e = m.emb_dim, m.resolved_head_dim, m.moe
    q, kv = m.num_heads * hd, m.resolved_kv_heads * hd
    attention = 2 * d * q + 2 * d * kv + (q + 2 * kv + d) + m.num_heads  # + biases, sinks
    router = d * e.num_experts + e.num_experts
    experts = e.num_experts * (3 * d * e.expert_mlp_dim + 2 * e.expert_mlp_dim + d)
    layer = attention + router + experts + 2 * d  # + the two block norms
    return 2 * m.vocab_size * d + m.num_layers * layer + d


# (preset, published total, published active) from OpenAI's gpt-oss model card (arXiv
# 2508.10925, table 1): 116.83B and 20.91B total; 5.13B and 3.61B active, which it counts
# without the input embedding (the unembedding included), as the dry-run's
# active_params_without_embedding does.
PUBLISHED_GPT_OSS = [
    ("gpt-oss-120b", 116.83e9, 5.13e9),
    ("gpt-oss-20b", 20.91e9, 3.61e9),
]


@pytest.mark.parametrize("case", PUBLISHED_GPT_OSS, ids=[p[0] for p in PUBLISHED_GPT_OSS])
def test_gpt_oss_presets_match_published_counts(case, tmp_path: Path) -> None:
    from maxtrain.models import active_param_count, embedding_lookup_params

    name, total, active = case
    m = load_preset(name, tmp_path)
    assert model_params(m) == gpt_oss_closed_form(m)
    assert_close(model_params(m), int(total), 0.001, f"{name} total")
    without_embedding = active_param_count(m) - embedding_lookup_params(m)
    assert_close(without_embedding, int(active), 0.002, f"{name} active")
    assert m.layers == ["sliding-moe", "global-moe"] and m.sliding_window == 128


# ---- Qwen3-Next (Gated DeltaNet layers beside gated attention, a gated shared expert) --------


def hybrid_closed_form(m: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of a Qwen3-Next- or Qwen3.5-shaped model from its shape keys:
    Gated DeltaNet layers (q, k, v, z, b, a and o projections, convolution taps over q, k and
    v, a decay and time-step bias per value head, the gated norm) and gated attention layers (q
    with its output gate, k, v, o, qk-norm) by model.layers; every layer a dense SwiGLU, or a
    MoE of routed experts, shared ones and the shared ones' gate; embedding and head tied or
    not."""
    d, e, la = m.emb_dim, m.moe, m.linear_attention
    hd, heads = m.resolved_head_dim, la.num_value_heads
    q, kv = m.num_heads * hd, m.resolved_kv_heads * hd
    attention = 3 * d * q + 2 * d * kv + 2 * hd
    key, value = la.num_key_heads * la.key_head_dim, heads * la.value_head_dim
    linear = d * (2 * key + 2 * value) + 2 * d * heads + value * d
    linear += la.conv_kernel * (2 * key + value) + 2 * heads + la.value_head_dim
    if e is None:
        ffn, inactive = 3 * d * m.mlp_dim, 0
    else:
        expert = 3 * d * e.expert_mlp_dim
        ffn = d * e.num_experts + (e.num_experts + e.shared_experts) * expert + d
        inactive = (e.num_experts - e.top_k) * expert
    full = sum(m.layer_attention(i) == "global" for i in range(m.num_layers))
    layers = full * attention + (m.num_layers - full) * linear + m.num_layers * (ffn + 2 * d)
    total = (1 if m.tie_embeddings else 2) * m.vocab_size * d + layers + d
    return total, total - m.num_layers * inactive


def test_qwen3_next_preset_matches_published_counts(tmp_path: Path) -> None:
    """Qwen3-Next-80B-A3B's model card: 80B total, 79B without the embeddings, 3B activated
    (whole billions). The dry-run's 79.67B total is within 0.5% of 80B; its activated count
    without the embedding and the head, 3.25B, is the one that rounds to the card's 3B (with the
    head 3.56B, with both 3.87B: the card's rounding cannot say which it counts, so this checks
    that it rounds to 3B, as GLM-4.5's whole-billion counts are checked)."""
    from maxtrain.models import active_param_count

    m = load_preset("qwen3-next-80b-a3b", tmp_path)
    closed_total, closed_active = hybrid_closed_form(m)
    assert (model_params(m), active_param_count(m)) == (closed_total, closed_active)
    assert closed_total == 79_674_391_296
    assert_close(closed_total, 80_000_000_000, 0.015, "qwen3-next-80b-a3b total")
    embedding_and_head = 2 * m.vocab_size * m.emb_dim
    assert_close(closed_total - embedding_and_head, 79_000_000_000, 0.015, "non-embedding")
    assert round((closed_active - embedding_and_head) / 1e9) == 3
    assert m.layers == ["linear-moe*3", "global-moe"]


def test_qwen3_5_presets_match_published_counts(tmp_path: Path) -> None:
    """Qwen3.5's published sizes are whole billions of the whole multimodal model: 9B for
    the dense model; 35B total and 3B activated for the MoE. Our presets are their language
    models (configs/models/qwen3.5-*.yml): 8.95B, within 0.6% of 9B; 34.66B, within 1% of 35B,
    with 3.45B active (2.95B without the input embedding), which rounds to 3B."""
    from maxtrain.models import active_param_count, embedding_lookup_params

    dense = load_preset("qwen3.5-9b", tmp_path)
    assert (model_params(dense), active_param_count(dense)) == hybrid_closed_form(dense)
    assert_close(model_params(dense), 9_000_000_000, 0.006, "qwen3.5-9b total")
    moe = load_preset("qwen3.5-35b-a3b", tmp_path)
    closed_total, closed_active = hybrid_closed_form(moe)
    assert (model_params(moe), active_param_count(moe)) == (closed_total, closed_active)
    assert_close(closed_total, 35_000_000_000, 0.01, "qwen3.5-35b-a3b total")
    assert round(closed_active / 1e9) == 3
    assert round((closed_active - embedding_lookup_params(moe)) / 1e9) == 3
    assert [m.layers for m in (dense, moe)] == [
        ["linear-dense*3", "global-dense"],
        ["linear-moe*3", "global-moe"],
    ]


def test_kimi_linear_preset_matches_published_counts(tmp_path: Path) -> None:
    """Kimi-Linear-48B-A3B's model card: 48B total, 3B activated. The preset counts 49.12B
    (2.3% over the card's whole billions: the tolerance says so) and 3.48B active, 3.11B
    without the input embedding, both rounding to 3B; 20 Kimi Delta Attention layers and 7
    NoPE MLA ones, as the published full_attn_layers place them."""
    from maxtrain.models import active_param_count, embedding_lookup_params

    m = load_preset("kimi-linear-48b-a3b", tmp_path)
    assert_close(model_params(m), 48_000_000_000, 0.025, "kimi-linear-48b-a3b total")
    active = active_param_count(m)
    assert round(active / 1e9) == round((active - embedding_lookup_params(m)) / 1e9) == 3
    full = [i + 1 for i in range(m.num_layers) if m.layer_attention(i) == "global"]
    assert full == [4, 8, 12, 16, 20, 24, 27]
    assert m.linear_attention.channel_decay and not m.mla.rope
