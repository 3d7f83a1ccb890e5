"""One Gated DeltaNet layer with transformers as the oracle: the fixtures of
tests/layers/test_gated_deltanet.py.

    python tools/make_gated_deltanet_fixture.py [--output tests/fixtures/gated_deltanet]
    python tools/make_gated_deltanet_fixture.py --kimi [--output DIR]

--kimi: Kimi Delta Attention instead (KimiLinearDeltaAttention: the decay per key channel;
default output tests/fixtures/kimi_delta_attention), four heads of 8 dims, its weights under
the names Kimi Linear's checkpoints give them (q_conv1d, k_conv1d and v_conv1d apart; the
forget gate's f_a_proj, f_b_proj, dt_bias and A_log beside the projections), as transformers
saves them.

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

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gated_deltanet"
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
KIMI_OUTPUT = DEFAULT_OUTPUT.parent / "kimi_delta_attention"
KIMI_SIZES = dict(
    hidden_size=32, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
    rms_norm_eps=1e-5,
)  # fmt: skip


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


def build_kimi(output: Path) -> None:
    """Kimi Delta Attention's fixture: as `build`, the forget gate's low-rank projection drawn
    so that its per-channel decays range from mild to strong within each head."""
    import torch
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    torch.manual_seed(SEED)
    config = KimiLinearConfig(
        **KIMI_SIZES, num_hidden_layers=1, layer_types=["linear_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    layer = KimiLinearDeltaAttention(config, layer_idx=0).eval()
    gate = layer.forget_gate
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
            getattr(layer, name).weight.normal_(0.0, 0.3)
        gate.f_a_proj.weight.normal_(0.0, 0.3)
        gate.f_b_proj.weight.normal_(0.0, 0.3)
        layer.conv1d.weight.normal_(0.0, 0.5)
        gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(0.05, 1.0).log())
        gate.dt_bias.normal_(-1.0, 0.5)
        layer.o_norm.weight.normal_(1.0, 0.3)
    x = torch.randn(INPUT_SHAPE, dtype=torch.float32)
    with torch.no_grad():
        y = layer(x)
    weights = {
        name.removeprefix("forget_gate."): t.numpy()
        for name, t in layer.state_dict().items()
        if name != "conv1d.weight"
    }
    for name, conv in zip("qkv", layer.conv1d.weight.detach().chunk(3), strict=True):
        weights[f"{name}_conv1d.weight"] = conv.numpy()
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(KIMI_SIZES, indent=2, sort_keys=True) + "\n")
    np.savez(output / "weights.npz", **weights)
    np.save(output / "x.npy", x.numpy())
    np.save(output / "y.npy", y.numpy())
    print(f"{output}: output rms {float(y.pow(2).mean().sqrt()):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kimi", action="store_true", help="Kimi Delta Attention's fixture")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.kimi:
        build_kimi(args.output or KIMI_OUTPUT)
    else:
        build(args.output or DEFAULT_OUTPUT)


if __name__ == "__main__":
    main()
