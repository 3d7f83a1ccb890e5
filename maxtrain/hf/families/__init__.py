"""The Hugging Face families we read and write: one module each, holding its entry `FAMILY`
(maxtrain/hf/family.py): its config.json keys, layer layout, aspects and tensors.

    llama.py        LlamaForCausalLM       mistral.py      MistralForCausalLM
    qwen3.py        Qwen3ForCausalLM       mixtral.py      MixtralForCausalLM
    qwen3_moe.py    Qwen3MoeForCausalLM    deepseek_v3.py  DeepseekV3ForCausalLM
    glm4_moe.py     Glm4MoeForCausalLM     llama4.py       Llama4ForCausalLM
    gemma3.py       Gemma3ForCausalLM      gpt_oss.py      GptOssForCausalLM
    qwen3_next.py   Qwen3NextForCausalLM   deepseek_v32.py DeepseekV32ForCausalLM
    glm_moe_dsa.py  GlmMoeDsaForCausalLM   kimi_linear.py  KimiLinearForCausalLM
    qwen3_5_text.py Qwen3_5ForCausalLM     qwen3_5_moe_text.py  Qwen3_5MoeForCausalLM

The registry is the package's modules: a new family is a new module here (and its fixture,
tools/make_hf_fixtures.py), nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from maxtrain.config import ModelConfig
from maxtrain.hf.family import Family


def _registered() -> dict[str, Family]:
    """model_type -> family, from every module of this package, in their names' order."""
    modules = sorted(info.name for info in pkgutil.iter_modules(__path__))
    families = [importlib.import_module(f"{__name__}.{name}").FAMILY for name in modules]
    return {family.model_type: family for family in families}


FAMILIES = _registered()


def family_for(cfg: ModelConfig) -> Family:
    """The family a model of ours exports as: of those that claim it, the one of highest rank
    (Llama claims every dense model and Mixtral every MoE one; config_map.py refuses what the
    family cannot express)."""
    return max((f for f in FAMILIES.values() if f.claims(cfg)), key=lambda f: f.rank)
