"""One Gated DeltaNet layer with transformers as the oracle: the fixture of
tests/layers/test_gated_deltanet.py.

    python tools/make_gated_deltanet_fixture.py [--output tests/fixtures/gated_deltanet]

A tiny Qwen3NextGatedDeltaNet (transformers 5.23.0) with random weights, its input and its
float32 output, into <output>/: config.json (the layer's sizes, as Qwen3NextConfig names them),
weights.npz (its state dict, transformers' names), x.npy [2, 20, D] and y.npy [2, 20, D].

The sizes are chosen so that a layout mistake shows: two query/key heads of 8 dims serving four
value heads of 6 (the fused projections interleave them per query/key head), 20 tokens (several
of our chunks of 8, the last partial). The weights are drawn large enough that the output is of
order one and a swapped head or tap moves it by as much, and the decays mild enough (exp(A_log)
in [0.05, 1], dt_bias around -1) that the state carries across the whole sequence.

It needs torch and transformers, run as make_hf_fixtures.py's docstring says (scratch/hf311);
transformers' pure-torch paths run (no fla or causal-conv1d kernels installed). This file imports
nothing from maxtrain: it describes the Hugging Face side independently.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

DEFAULT_OUTPUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gated_deltanet"
SIZES = dict(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)
INPUT_SHAPE = (2, 20, SIZES["hidden_size"])
SEED = 37


def build(output: Path) -> None:
    import torch
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(SEED)
    config = Qwen3NextConfig(**SIZES, num_hidden_layers=1, layer_types=["linear_attention"])
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            getattr(layer, name).weight.normal_(0.0, 0.3)
        layer.conv1d.weight.normal_(0.0, 0.5)
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.05, 1.0).log())
        layer.dt_bias.normal_(-1.0, 0.5)
        layer.norm.weight.normal_(1.0, 0.3)
    x = torch.randn(INPUT_SHAPE, dtype=torch.float32)
    with torch.no_grad():
        y = layer(x)
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(SIZES, indent=2, sort_keys=True) + "\n")
    weights = {name: t.numpy() for name, t in layer.state_dict().items()}
    np.savez(output / "weights.npz", **weights)
    np.save(output / "x.npy", x.numpy())
    np.save(output / "y.npy", y.numpy())
    print(f"{output}: output rms {float(y.pow(2).mean().sqrt()):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    build(parser.parse_args(argv).output)


if __name__ == "__main__":
    main()
