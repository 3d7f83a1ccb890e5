"""A tiny model learns: the loss falls on a short run through the real loop."""

import json

from maxtrain.training.loop import run


def test_loss_falls_on_a_tiny_run(make_cfg):
    cfg = make_cfg(
        "train.steps=40",
        "train.log_every=5",
        "optim.lr=1e-2",
        "optim.warmup_steps=5",
        "train.eval_every=40",
        "mesh.fsdp=2",
        "mesh.data=4",
    )
    summary = run(cfg)
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert losses[0] > 5.0  # ~log(256) at the start
    assert losses[-1] < 0.6 * losses[0]
    assert summary["eval/loss"] < 0.6 * losses[0]
