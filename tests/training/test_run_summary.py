"""The start-up line says what a run trains: where its parameters start and how its matmuls
compute, besides their count."""

from maxtrain import config as config_lib
from maxtrain.training import run_summary

BASE = config_lib.CONFIGS_DIR / "base.yml"


def test_the_start_up_line_names_the_start_checkpoint_and_quantized_matmuls():
    plain = run_summary.describe_start(config_lib.load(BASE, ["model_name=tiny"]))
    assert "from " not in plain and "matmuls" not in plain
    tuned = config_lib.load(
        BASE,
        [
            "model_name=tiny",
            "checkpoint.load_parameters_path=ckpt/base",
            "quantization.preset=int8",
        ],
    )
    line = run_summary.describe_start(tuned)
    assert "active per token), from ckpt/base, int8 matmuls, " in line


def test_the_eval_line_shows_an_objectives_own_scores_beside_the_loss():
    """DPO's held-out accuracy and reward margin are on the eval line (it showed only the loss
    and a perplexity, which means nothing for DPO); per-source losses and task scores keep
    their own places."""
    from maxtrain.training.cadence import format_eval

    ev = {"loss": 0.6, "perplexity": 1.8, "pairs/loss": 0.6, "dpo/accuracy": 0.75,
          "dpo/reward_margin": 0.25, "arith/acc": 0.5, "arith/acc_norm": 0.4}  # fmt: skip
    line = format_eval(10, ev)
    assert line.startswith("eval  step 10: loss 0.6000, ppl 1.80 (pairs 0.600), ")
    assert "dpo/accuracy 0.750, dpo/reward_margin 0.250; arith/acc 0.500" in line
    assert "acc_norm" not in line
