"""Generation: the cached decode equals the full forward pass, a multi-head latent attention
model caches its latent only and a local layer its window, and greedy generation from imported
Hugging Face models (GQA, GLM-4.5's, Mistral's sliding window, Llama 4's chunked and NoPE
layers, Gemma 3's sliding windows, GPT-OSS's windows and sinks, DeepSeek-V3's MLA) is
token-identical to transformers' generate().

The oracle for the second is tests/fixtures/hf/*/generate.json (tools/make_hf_fixtures.py
generate): the tokens transformers' greedy generate() appended to each prompt, one prompt at a
time; here all prompts run in one batch, of different lengths.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import support
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import evaluate as evaluate_cli
from maxtrain import generate as generate_cli
from maxtrain import models as model_lib
from maxtrain.checkpointing.export import save_parameters
from maxtrain.hf.convert import import_checkpoint
from maxtrain.inference.decode import cache_stacks
from maxtrain.layers.kv_cache import init_cache
from maxtrain.tokenizers import DEFAULT_TOKENIZER
from maxtrain.training import run_model

FIXTURES = support.FIXTURES / "hf"
TOLERANCE = 2e-5  # float32 rounding: the cache path sums attention over more (masked) keys


WINDOW_3 = ("model.sliding_window=3",)
# Gated DeltaNet layers in chunks of 4: the 5-token prompt's prefill takes two.
LINEAR = (
    "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, "
    "value_head_dim: 8, chunk: 4}",
)
# Qwen3-Next's shape, tiny: three linear layers then a gated attention layer, MoE with a gated
# shared expert.
HYBRID = (
    "model_name=tiny-moe", "model.num_layers=4", "model.layers=[linear-moe*3, global-moe]",
    *LINEAR, "model.attention_output_gate=true", "model.moe.shared_experts=1",
    "model.moe.shared_expert_gate=true", "model.rope.fraction=0.25",
)  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [
        ("model_name=tiny-qk",),
        # A dense first layer, then MoE layers of both kinds: a global one between two sliding
        # ones, whose ring of 3 positions is shorter than row 0's 5-token prompt.
        (
            "model_name=tiny-moe", "model.num_layers=4", "model.mlp_dim=128",
            "model.layers=[global-dense, sliding-moe, global-moe, sliding-moe]", *WINDOW_3,
        ),
        ("model_name=tiny-mla",),
        # DeepSeek sparse attention: 3 keys per query of the 12, from the cache's index keys
        ("model_name=tiny-mla", "model.mla.indexer={heads: 4, head_dim: 16, top_k: 3}"),
        # Every layer sliding (Mistral); sliding and global alternating in one stack; Llama 4's
        # chunked layers, chunks of 4, beside its nope layers.
        ("model.layers=[sliding-dense]", *WINDOW_3),
        ("model.num_layers=3", "model.layers=[sliding-dense, global-dense]", *WINDOW_3),
        ("model.layers=[chunked-dense, nope-dense]", "model.attention_chunk=4"),
        HYBRID,
        # Linear and attention layers alternating, dense: runs of one layer from two stacks.
        ("model.layers=[linear-dense, global-dense]", *LINEAR),
        # Kimi Delta Attention's linear layers (a decay per key channel) beside attention.
        (
            "model.layers=[linear-dense, global-dense]",
            "model.linear_attention={num_key_heads: 4, num_value_heads: 4, key_head_dim: 8, "
            "value_head_dim: 8, chunk: 4, channel_decay: true}",
        ),
    ],
    ids=[
        "dense-qk-norm", "moe-after-dense-mixed", "mla", "mla-sparse", "window", "window-mixed",
        "chunk", "hybrid-moe", "hybrid-alternating", "kimi-delta-alternating",
    ],
)  # fmt: skip
def test_cached_decode_equals_the_full_forward(make_cfg, overrides):
    """A prefill of padded prompts (row 1's is 3 tokens, padded to 5 with other tokens at
    position -1, as generate's prefill gives them) then one token per step at each row's own
    position gives, at every real position, the logits the uncached model computes for the
    whole sequence."""
    cfg = make_cfg(*overrides)
    mdef = run_model.model_def(cfg, pipelined=False)
    params = nnx.to_pure_dict(
        nnx.state(model_lib.build(run_model.model_spec(cfg), seed=3), nnx.Param)
    )
    T, lengths = 12, np.array([5, 3])
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, cfg.model.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T), (2, T))
    forward = jax.jit(lambda p, t: mdef.apply(p, t, positions, jnp.ones_like(t)).logits)
    full = np.asarray(forward(params, tokens))

    cache = init_cache(cfg.model, cache_stacks(cfg.model), 2, T, jnp.float32)
    decode = jax.jit(mdef.decode)
    padded = tokens[:, :5].at[1, 3:].set(7)  # row 1: its 3 prompt tokens, then padding
    logits, cache = decode(params, padded, positions[:, :5].at[1, 3:].set(-1), cache)
    got = [[logits[0, p] for p in range(5)], [logits[1, p] for p in range(3)]]
    for step in range(T - 5):
        pos = jnp.asarray(lengths + step)[:, None]
        step_logits, cache = decode(params, jnp.take_along_axis(tokens, pos, 1), pos, cache)
        for row in range(2):
            got[row].append(step_logits[row, 0])
    for row, length in enumerate(lengths):
        seen = len(range(length + T - 5))
        diff = np.abs(np.stack(got[row]) - full[row, :seen]).max()
        assert diff <= TOLERANCE * max(1.0, np.abs(full).max()), f"row {row}: {diff:.2e}"


@pytest.mark.parametrize("model_name", ["tiny-mla", "deepseek-v3-671b", "kimi-k2-1t"])
def test_an_mla_cache_holds_only_the_latent_and_the_rope_key(model_name):
    """Generation's cache of a multi-head latent attention model holds, per layer and position,
    kv_lora_rank + qk_rope_head_dim elements (576 for DeepSeek-V3 and Kimi K2), not per-head
    keys and values: N x (qk_head_dim + v_head_dim) (40,960 and 20,480)."""
    model, B, S = config_lib.load(support.BASE, [f"model_name={model_name}"]).model, 2, 16
    cache = jax.eval_shape(lambda: init_cache(model, cache_stacks(model), B, S, jnp.bfloat16))
    elements = sum(a.size for a in jax.tree.leaves(cache))
    m = model.mla
    assert elements == model.num_layers * B * S * (m.kv_lora_rank + m.qk_rope_head_dim)
    assert m.kv_lora_rank + m.qk_rope_head_dim < model.num_heads * (m.qk_head_dim + m.v_head_dim)


@pytest.mark.parametrize(
    "overrides, local, length",
    [
        # Mistral 7B: 32 layers, each a window of 4096, generating 32768 positions.
        (["model_name=mistral-7b"], 4096, 32768),
        # A shorter generation than the window: the ring holds the generation (5 positions).
        (["model.layers=[sliding-dense]", "model.sliding_window=8"], 5, 5),
        # Sliding and global layers in a dense and a MoE stack: each stack keeps one array per
        # kind.
        (["model_name=tiny-moe", "model.num_layers=5", "model.mlp_dim=128",
          "model.layers=[sliding-dense*2, global-moe, sliding-moe*2]", *WINDOW_3], 3, 40),
    ],
    ids=["mistral-7b", "shorter-than-the-window", "mixed-stacks"],
)  # fmt: skip
def test_a_sliding_layer_caches_its_window_not_the_generation(make_cfg, overrides, local, length):
    """The decode cache of a sliding layer is a ring of its window's positions: per stack, the
    sliding layers' keys and values [L_sliding, B, window, K, H], the global layers'
    [L_global, B, length, K, H]; memory O(window), not O(length), for sliding layers."""
    model, B = make_cfg(*overrides).model, 2
    cache = jax.eval_shape(lambda: init_cache(model, cache_stacks(model), B, length, jnp.bfloat16))
    K, H = model.resolved_kv_heads, model.resolved_head_dim
    kinds = [(model.is_moe_layer(i), model.layer_attention(i)) for i in range(model.num_layers)]
    for stack, is_moe in (("layers", False), ("moe_layers", True)):
        for kind, positions in (("sliding", local), ("global", length)):
            layers = kinds.count((is_moe, kind))
            held = cache.get(stack, {}).get(kind)
            assert (held is None) == (layers == 0), (stack, kind)
            if layers:
                assert held.k.shape == held.v.shape == (layers, B, positions, K, H), (stack, kind)


def test_a_linear_layer_caches_a_state_not_the_generation(make_cfg):
    """The decode cache of a Gated DeltaNet layer is its state: per linear stack the
    convolution's last conv_kernel - 1 inputs [L, B, 3, 2 Nk dk + Nv dv] and the rule's float32
    state [L, B, Nv, dk, dv], the same for 16 positions as for 4096 (O(1) in the length); the
    attention layer beside them keeps keys and values of every position."""
    model, B = make_cfg(*HYBRID).model, 2
    la = model.linear_attention
    channels = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    state = (la.num_value_heads, la.key_head_dim, la.value_head_dim)
    for length in (16, 4096):
        cache = jax.eval_shape(
            lambda length=length: init_cache(model, cache_stacks(model), B, length, jnp.bfloat16)
        )
        assert sorted(cache) == ["linear_moe_layers", "moe_layers"]
        linear = cache["linear_moe_layers"]["linear"]
        assert list(cache["linear_moe_layers"]) == ["linear"]
        assert (linear.conv.shape, linear.conv.dtype) == ((3, B, 3, channels), jnp.bfloat16)
        assert (linear.recurrent.shape, linear.recurrent.dtype) == ((3, B, *state), jnp.float32)
        assert cache["moe_layers"]["global"].k.shape[:3] == (1, B, length)


def test_greedy_generation_of_a_hybrid_model_follows_its_training_forward(make_cfg, tmp_path):
    """`python -m maxtrain.generate` on the Qwen3-Next-shaped tiny model, prompts of 9, 2 and 6
    tokens in one batch (chunks of 4), on 8 devices (its DeltaNet states split by value head
    over tensor, its experts over expert) and on 1: each new token is the argmax of the
    training path's logits over the prompt and the tokens before it, and both meshes agree."""
    cfg = make_cfg(*HYBRID, "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2")
    init = lambda: nnx.to_pure_dict(
        nnx.state(model_lib.build(run_model.model_spec(cfg), 5), nnx.Param)
    )
    params = jax.jit(init)()
    save_parameters(tmp_path / "ckpt", params, config_yaml=config_lib.to_yaml(cfg))
    prompts = [list(range(11, 20)), [3, 4], [100, 90, 80, 70, 60, 50]]
    lines = "".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts)
    (tmp_path / "prompts.jsonl").write_text(lines)
    out = tmp_path / "out.jsonl"
    args = [str(tmp_path / "ckpt"), "--prompts", str(tmp_path / "prompts.jsonl")]
    new = []
    for devices in ([], ["--devices", "1"]):
        cli = [*args, *devices, "--max-new-tokens", "6", "--output", str(out)]
        assert generate_cli.main(cli) == 0
        new.append([json.loads(line)["new_ids"] for line in out.read_text().splitlines()])
    assert new[0] == new[1]
    mdef = run_model.model_def(cfg, pipelined=False)
    forward = jax.jit(
        lambda t: mdef.apply(params, t, jnp.arange(t.shape[1])[None], jnp.ones_like(t)).logits
    )
    # One forward of all rows (one program), each right-padded: a causal model's logits at a
    # row's positions do not see the padding after them.
    rows = [prompt + tokens for prompt, tokens in zip(prompts, new[0], strict=True)]
    width = max(map(len, rows))
    logits = forward(jnp.asarray([row + [0] * (width - len(row)) for row in rows]))
    for logits_row, prompt, row in zip(logits, prompts, rows, strict=True):
        tokens = row[len(prompt) :]
        assert tokens == np.argmax(logits_row[len(prompt) - 1 : len(row) - 1], axis=-1).tolist()


@pytest.mark.parametrize(
    "case, mesh",
    [
        ("llama_gqa_untied_sharded", ["--devices", "1"]),
        ("qwen3_gqa4_untied_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),  # 8 devices
        # DeepSeek-V3's multi-head latent attention decoding from its latent cache, 20 new
        # tokens: YaRN (past its original 32 positions) with a query latent, and a plain query
        # with rotate-half pairs.
        ("deepseek_v3_q_lora_yarn_v5", ["--devices", "1"]),
        ("deepseek_v3_plain_q_half_rope_legacy", ["mesh.fsdp=4", "mesh.tensor=2"]),
        # DeepSeek-V3.2's sparse attention: each query reads the 4 keys its indexer picks from
        # the cache's index keys, prompts of 1 to 29 tokens and 16 new ones, over 8 devices.
        ("deepseek_v32_indexer_top4_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),
        ("glm_moe_dsa_indexer_top4_v5", ["--devices", "1"]),  # its indexer's RoPE interleaved
        # GLM-4.5: q/k/v biases, qk-norm, a quarter of each head rotated, sigmoid routing with
        # a shared expert after a dense layer; 16 new tokens, weights split over fsdp x tensor.
        ("glm4_moe_qk_norm_quarter_rope_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),
        # Llama 4, 16 new tokens: chunks of 4 on the RoPE layers, the NoPE layer's temperature
        # changing every 4 positions, experts weighing their inputs, split over 8 devices.
        ("llama4_chunked_nope_moe_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),
        # Mistral's window of 4 from a ring of 4 positions, 16 new tokens: every prompt and
        # the second one's prefill (29 tokens) run past the window.
        ("mistral_window4_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),
        # Gemma 3, 16 new tokens, prompts of 1 to 29 tokens: sliding windows of 4 and 3 keys,
        # far shorter than prompt + generation, each layer from a ring of its window.
        ("gemma3_window4_linear_rope_v5", ["--devices", "1"]),
        ("gemma3_period3_mqa_untied_legacy_bf16", ["mesh.fsdp=4", "mesh.tensor=2"]),
        # GPT-OSS: sliding windows of 4 (prompts of 1 to 29 tokens, 16 new), attention sinks,
        # biases, untruncated YaRN; on 8 devices the heads, sinks and experts' hidden units
        # split over tensor.
        ("gpt_oss_window_sinks_yarn_v5", ["--devices", "1"]),
        ("gpt_oss_window_sinks_yarn_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),
        # Qwen3-Next: Gated DeltaNet layers generating from their states (conv window and
        # recurrent state, prompts right-padded in one prefill) beside a gated attention
        # layer's keys and values, MoE with a gated shared expert, over 8 devices.
        ("qwen3_next_hybrid_moe_v5", ["mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"]),
        # Qwen3.5: the same hybrid with the Gated DeltaNet's projections stored apart, half
        # of each head rotated, tied; its MoE every layer MoE. 16 new tokens each.
        ("qwen3_5_text_tied_mrope_v5", ["mesh.fsdp=4", "mesh.tensor=2"]),
        ("qwen3_5_moe_text_v5", ["mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"]),
        # Kimi Linear: Kimi Delta Attention layers (a decay per key channel) generating from
        # their states beside a NoPE latent-attention layer's cached latents, sigmoid routing;
        # 16 new tokens over 8 devices.
        ("kimi_linear_kda_nope_mla_v5", ["mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"]),
    ],
)
def test_greedy_generation_from_an_import_equals_transformers(case, mesh, tmp_path, capsys):
    """The tools' path: tools/convert_hf.py's import (which keeps the tokenizer), then
    `python -m maxtrain.generate` with text prompts of different lengths in one batch, on one
    device and on 8 with the weights and cache split over fsdp and tensor."""
    oracle = json.loads((FIXTURES / case / "generate.json").read_text())
    import_checkpoint(FIXTURES / case, tmp_path / "ckpt")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c["prompt"]}) + "\n" for c in oracle["cases"]))
    out = tmp_path / "out.jsonl"
    args = [str(tmp_path / "ckpt"), *mesh, "--prompts", str(prompts), "--output", str(out)]
    assert generate_cli.main([*args, "--max-new-tokens", str(oracle["max_new_tokens"])]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["prompt_ids"] for line in lines] == [c["prompt_ids"] for c in oracle["cases"]]
    assert [line["new_ids"] for line in lines] == [c["new_ids"] for c in oracle["cases"]]
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x' is not comma-separated integers"),
        (["--prompt", "a", "--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--prompt", "a", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        ([], "no prompt given"),
        (["--prompt", "a"], "no complete checkpoint found at"),
    ],
)
def test_bad_generate_input_is_one_line(tmp_path, capsys, args, message):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": 3}\n')
    assert generate_cli.main([str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bad_prompts_file_line_is_named(tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert generate_cli.main([str(tmp_path), "--prompts", str(tmp_path / "prompts.jsonl")]) == 2
    assert 'prompts.jsonl:2: expected an object with "prompt"' in capsys.readouterr().err


@pytest.mark.parametrize(
    "cli, options",
    [
        (generate_cli, ["--prompt", "a", "--stop", r"\n\n", "--max-new-tokens", "4"]),
        (evaluate_cli, ["--tasks", "arithmetic", "--shots", "2", "--loss"]),
    ],
    ids=["generate", "evaluate"],
)
def test_overrides_stand_anywhere_among_the_options(cli, options):
    """docs/generation.md's headline command ends in its overrides, after the options (it was
    "unrecognized arguments: mesh.fsdp=4 mesh.tensor=2"): before, between and after the
    options, the same overrides and the same options."""
    overrides = ["mesh.fsdp=4", "mesh.tensor=2"]
    orders = [
        ["ckpt", *overrides, *options],
        ["ckpt", overrides[0], *options[:2], overrides[1], *options[2:]],
        ["ckpt", *options, *overrides],
        [*options[:2], "ckpt", *options[2:], *overrides],
    ]
    parsed = [vars(cli._parser().parse_args(argv)) for argv in orders]
    assert parsed[0]["overrides"] == overrides and parsed[0]["checkpoint"] == "ckpt"
    assert all(p == parsed[0] for p in parsed), parsed


def test_a_stop_string_typed_with_an_escape_stops_generation(tmp_path, capsys):
    r"""`--stop "\r\r"` as bash passes it (a backslash and an r, twice) stops at two carriage
    returns: transformers' greedy continuation of the Qwen3 fixture's first prompt starts with
    id 17, which the default tokenizer decodes as "\r" (byte 0x0D after its 4 special ids)."""
    case = json.loads((FIXTURES / "qwen3_gqa4_untied_v5" / "generate.json").read_text())["cases"][0]
    assert case["new_ids"][:3] == [17, 17, 17]
    import_checkpoint(FIXTURES / "qwen3_gqa4_untied_v5", tmp_path / "ckpt")
    out = tmp_path / "out.jsonl"
    ids = ",".join(map(str, case["prompt_ids"]))
    base = [str(tmp_path / "ckpt"), "--prompt-ids", ids, "--tokenizer", str(DEFAULT_TOKENIZER)]
    args = [*base, "--max-new-tokens", "12", "--devices", "1", "--output", str(out)]
    assert generate_cli.main([*args, "--stop", r"\r\r"]) == 0
    line = json.loads(out.read_text())
    assert (line["finish"], line["new_ids"], line["text"]) == ("stop", [17, 17], "")
    with pytest.raises(SystemExit) as refused:  # argparse's usage error: exit 2, one line
        generate_cli.main([*base, "--stop", r"\q"])
    assert refused.value.code == 2
    assert r"unknown escape \q in '\q'" in capsys.readouterr().err


def test_an_import_with_fewer_positions_than_the_training_default_generates(tmp_path):
    """A model of 64 positions is sampled: train.seq_len's default (128) is for training and
    was refused against it ("train.seq_len (128) exceeds model.max_seq_len (64)")."""
    case = Path(shutil.copytree(FIXTURES / "llama_gqa_untied_sharded", tmp_path / "in"))
    config = json.loads((case / "config.json").read_text())
    (case / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    import_checkpoint(case, tmp_path / "ckpt")
    out = tmp_path / "out.jsonl"
    args = [str(tmp_path / "ckpt"), "--prompt", "the cat", "--max-new-tokens", "3"]
    assert generate_cli.main([*args, "--devices", "1", "--output", str(out)]) == 0
    assert len(json.loads(out.read_text())["new_ids"]) == 3


def test_a_run_trained_on_8_devices_samples_on_1(make_cfg, tmp_path, capsys):
    """A checkpoint saved under mesh fsdp=2 x tensor=4 (8 devices) generates with --devices 1
    and no mesh override: the weights go on a mesh of the device there is, with a line saying
    so, and the greedy tokens are those of the saved mesh. A mesh the user names that does not
    fit is still refused."""
    cfg = make_cfg("mesh.fsdp=2", "mesh.tensor=4")
    init = lambda: nnx.to_pure_dict(
        nnx.state(model_lib.build(run_model.model_spec(cfg), 0), nnx.Param)
    )
    save_parameters(tmp_path / "ckpt", jax.jit(init)(), config_yaml=config_lib.to_yaml(cfg))
    out = tmp_path / "out.jsonl"
    args = [str(tmp_path / "ckpt"), "--prompt-ids", "1,2,3", "--max-new-tokens", "6"]
    tokens = []
    for devices in ([], ["--devices", "1"]):
        assert generate_cli.main([*args, *devices, "--output", str(out)]) == 0
        tokens.append(json.loads(out.read_text())["new_ids"])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    printed = capsys.readouterr().out
    assert "saved mesh (fsdp=2 x tensor=4, 1 slice(s)) does not fit 1 device(s)" in printed
    assert printed.count("does not fit") == 1  # 8 devices: the saved mesh as it is
    assert generate_cli.main([*args, "--devices", "1", "mesh.tensor=4"]) == 2
    assert "(fsdp=2 x tensor=4) use 8 devices per slice but 1 are" in capsys.readouterr().err


def test_a_parameters_only_checkpoint_is_not_called_step_0():
    """An import, a merge or a quantized export has no training step: generate and evaluate
    say so instead of "step 0"; a run's step and its start are named as such."""
    from maxtrain.inference.loading import LoadedModel

    def source(step, initial=False):
        return LoadedModel(None, None, None, None, Path("ckpt/0"), step, initial).source()

    assert source(0) == "ckpt/0 (parameters only: no training step)"
    assert source(300) == "step 300 of ckpt/0"
    assert source(0, initial=True) == "the initial parameters of the run of ckpt/0"
