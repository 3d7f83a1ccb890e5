"""Hugging Face checkpoints in and out: Llama, Qwen3, Mixtral and Qwen3-MoE.

    families.py        the four transformers architectures, as data (config keys, names)
    config_map.py      config.json (both layouts) <-> ModelConfig
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
