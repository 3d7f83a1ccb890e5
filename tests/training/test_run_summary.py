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
