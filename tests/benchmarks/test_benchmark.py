"""The benchmark says under which routing an MoE step was timed: tiny-moe's step with its
experts split over 4 of 8 simulated devices and exchange buffers of exactly the fair share of
rows (compute.expert_exchange_capacity 1.0), timed once under its learned routing and once
under the balanced diagnostic (compute.balanced_routing)."""

import pytest

from maxtrain import config as config_lib
from maxtrain.benchmarks import step as benchmark

BASE = str(config_lib.CONFIGS_DIR / "base.yml")


@pytest.mark.parametrize("balanced", [False, True], ids=["learned", "balanced"])
def test_benchmark_reports_the_routing_and_its_imbalance(tmp_path, balanced):
    cfg = config_lib.load(
        BASE,
        [
            "model_name=tiny-moe",
            "data.kind=synthetic",
            f"run.output_dir={tmp_path}",
            "train.global_batch_size=8",
            "train.seq_len=32",
            "mesh.expert=4",
            "compute.expert_exchange_capacity=1.0",
            f"compute.balanced_routing={str(balanced).lower()}",
        ],
    )
    result = benchmark.benchmark(cfg, steps=1, warmup=0, profile_dir=None)
    assert result["moe_dropped"] == 0.0  # dropless: the rounds carry what does not fit
    if balanced:
        # Every expert gets its fair share on every device: nothing waits for a second round.
        assert result["routing"] == "balanced (diagnostic)"
        assert (result["moe_max_load"], result["moe_rounds"]) == (1.0, 1)
    else:
        # The initial router's choices are uneven: the busiest expert takes more than its
        # share, and some pair of devices more rows than a buffer of the fair share holds.
        assert result["routing"] == "learned"
        assert result["moe_max_load"] > 1.0 and result["moe_rounds"] >= 2
