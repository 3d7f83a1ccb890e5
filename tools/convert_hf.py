"""Hugging Face checkpoints in and out of maxtrain.

    python tools/convert_hf.py import --hf-dir DIR --output CKPT
    python tools/convert_hf.py export --checkpoint CKPT --output DIR

import reads a Llama, Qwen3, Mixtral or Qwen3-MoE model directory (config.json + safetensors,
sharded or not) and writes a parameters-only checkpoint that `checkpoint.load_parameters_path`
starts a run from, with the model file CKPT/model.yml. export writes the parameters of any
maxtrain checkpoint (the model is the config saved with it) as a directory that transformers'
AutoModelForCausalLM loads. Both stream tensor by tensor (maxtrain/hf/).
"""

from __future__ import annotations

import os
import sys

# Conversion is host work: keep jax off any accelerator (and its memory) unless asked.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from maxtrain.hf.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
