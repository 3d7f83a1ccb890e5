"""Hugging Face checkpoints in and out, one module per transformers family.

    families/          one module per family (Llama, Mistral, Qwen3, Mixtral, Qwen3-MoE,
                       DeepSeek-V3, GLM-4.5, Llama 4, Gemma 3, GPT-OSS, Qwen3-Next): its
                       config.json keys, layer layout, aspects and tensor names
    family.py          what a family entry holds; aspect.py the parts it is made of
    config_map.py      config.json (both layouts) <-> ModelConfig: the keys every family shares
    rope.py            RoPE's keys; layer_layout.py the per-layer layouts <-> model.layers
    attention.py, feed_forward.py   the aspects several families share
    layout.py          each Hugging Face tensor's place and layout in our parameter tree
    safetensors_io.py  streaming safetensors reader and writer
    convert.py         import / export, tensor by tensor, outputs written atomically
    cli.py             tools/convert_hf.py

transformers is the oracle: tests/hf/test_convert_hf.py compares our logits with the ones it
computed on the committed fixtures (tools/make_hf_fixtures.py builds them).
"""

from maxtrain.hf.convert import (
    export_checkpoint,
    import_checkpoint,
    read_hf_model,
    write_hf_model,
)
from maxtrain.hf.errors import ConversionError

__all__ = [
    "ConversionError",
    "export_checkpoint",
    "import_checkpoint",
    "read_hf_model",
    "write_hf_model",
]
