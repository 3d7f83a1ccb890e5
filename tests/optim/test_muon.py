"""Muon (maxtrain/optim/muon.py) against a NumPy implementation of the published algorithm, and a
run with it resumed bit-exactly (sharded against one device: test_muon_deal.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from support.optim import apply, muon_cfg
from support.runs import stopped_at

from maxtrain import optim
from maxtrain.checkpointing import load_parameters
from maxtrain.training.loop import run
from maxtrain.training.run_model import model_def

COEFFS = (3.4445, -4.7750, 2.0315)


def published_newton_schulz(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Keller Jordan's zeropower_via_newtonschulz5, in float64 NumPy."""
    a, b, c = COEFFS
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def published_muon(w, grads, lr, momentum=0.95, weight_decay=0.1, rms_scale=0.2):
    """Muon with Nesterov momentum and Moonlight's update scale, step by step on one matrix."""
    buf = np.zeros_like(w)
    for g in grads:
        buf = momentum * buf + g
        update = published_newton_schulz(g + momentum * buf)
        w = w - lr * (rms_scale * np.sqrt(max(w.shape)) * update + weight_decay * w)
    return w


def test_three_updates_match_the_published_algorithm_per_layer_matrix():
    """A layer-stacked MLP kernel [2, 12, 20] (each layer its own matrix), a tall expert
    kernel [2, 20, 12] and a q kernel [embed, heads, head_dim] (one embed x heads*head_dim
    matrix), three steps of momentum; the embedding goes to AdamW untouched by Muon."""
    rng = np.random.default_rng(0)
    params = {
        "embedding": rng.standard_normal((16, 12)),
        "layers": {
            "mlp": {"up": {"kernel": rng.standard_normal((2, 12, 20))}},
            "moe": {"down": {"kernel": rng.standard_normal((2, 20, 12))}},
            "attn": {"q": {"kernel": rng.standard_normal((12, 2, 5))}},
        },
    }
    grads = [jax.tree.map(lambda x: rng.standard_normal(x.shape), params) for _ in range(3)]
    f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)  # noqa: E731
    cfg = muon_cfg()
    tx, _ = optim.build(cfg, 10)
    new = apply(tx, f32(params), [f32(g) for g in grads])

    for path in (("mlp", "up"), ("moe", "down")):
        for layer in range(2):
            leaf = lambda t: t["layers"][path[0]][path[1]]["kernel"][layer]  # noqa: B023, E731
            expected = published_muon(leaf(params), [leaf(g) for g in grads], cfg.lr)
            np.testing.assert_allclose(leaf(new), expected, rtol=2e-5, atol=2e-5)
    q = params["layers"]["attn"]["q"]["kernel"]
    q_grads = [g["layers"]["attn"]["q"]["kernel"].reshape(12, 10) for g in grads]
    expected = published_muon(q.reshape(12, 10), q_grads, cfg.lr).reshape(q.shape)
    np.testing.assert_allclose(new["layers"]["attn"]["q"]["kernel"], expected, atol=2e-5)

    adamw = optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    embedding = apply(adamw, f32(params["embedding"]), [f32(g["embedding"]) for g in grads])
    np.testing.assert_allclose(new["embedding"], embedding, rtol=1e-6)


def test_a_muon_run_stopped_and_resumed_is_bit_exact(make_cfg, tmp_path, capsys):
    """4 steps straight vs stopped at its step-2 checkpoint, then a restart to 4: the same
    losses and parameters, bit for bit (the momentum buffers come back from the checkpoint)."""
    common = ("optim.name=muon", "optim.schedule=constant", "train.log_every=1",
              "checkpoint.local.every_steps=2")  # fmt: skip
    straight_cfg = make_cfg("run.name=straight", "train.steps=4", *common)
    run(straight_cfg)
    resumed_cfg = make_cfg("run.name=resumed", "train.steps=4", *common)
    stopped_at(straight_cfg.run_dir, 2, resumed_cfg.run_dir)
    capsys.readouterr()
    run(resumed_cfg)
    assert "resumed at step 2" in capsys.readouterr().out

    def losses(cfg):
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}

    assert losses(resumed_cfg) == losses(straight_cfg) and len(losses(straight_cfg)) == 4
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
        nnx.to_pure_dict(model_def(straight_cfg).abstract_state),
    )
    final = [
        load_parameters(cfg.run_dir / "checkpoints", target) for cfg in (straight_cfg, resumed_cfg)
    ]
    for a, b in zip(*map(jax.tree.leaves, final), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
