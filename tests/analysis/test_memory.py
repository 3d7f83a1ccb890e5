"""The dry-run memory estimate against XLA's buffer assignment for the same compiled step."""

import json

import jax
import pytest
from support.data import load_tool

from maxtrain import config as config_lib
from maxtrain.analysis import memory
from maxtrain.config import CONFIGS_DIR, REPO_ROOT
from maxtrain.training.trainer import build_trainer, compile_step


def compiled_bytes_per_device(cfg) -> int:
    """Arguments (params, optimizer state, batch) plus temporaries of the compiled step,
    compiled from shapes alone: XLA's buffer assignment does not depend on the values, so
    nothing is initialised and no batch is read."""
    compiled, _, _ = compile_step(build_trainer(cfg, abstract=True))
    analysis = compiled.memory_analysis()
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes


@pytest.mark.parametrize(
    "overrides",
    [
        ("mesh.fsdp=8",),  # parameters and optimizer state sharded 8 ways
        ("mesh.fsdp=1", "mesh.data=8"),  # replicated: the state dominates
        ("mesh.fsdp=8", "compute.remat=none", "train.global_batch_size=16"),
        ("mesh.fsdp=8", "compute.remat=minimal", "train.global_batch_size=64"),
        (
            "mesh.fsdp=2",
            "mesh.expert=4",
            "model_name=tiny-moe",
            "model.vocab_size=256",
            "compute.remat=minimal",
        ),
        # every layer a sliding window of 64 over 1024 tokens: the scores are a band
        (
            "mesh.fsdp=8",
            "train.seq_len=1024",
            "train.global_batch_size=8",
            "model.layers=[sliding-dense]",
            "model.sliding_window=64",
        ),
        # Gated DeltaNet in 3 of 4 layers: their projections and chunk states, no K/V
        (
            "mesh.fsdp=8",
            "compute.remat=minimal",
            "train.global_batch_size=64",
            "model.layers=[linear-dense*3, global-dense]",
            "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 32, "
            "value_head_dim: 32, chunk: 32}",
        ),
        # 1F1B keeps the layers' inputs of the micro-batches in flight (at most S of them)
        (
            "mesh.stage=2",
            "mesh.fsdp=4",
            "pipeline.schedule=1f1b",
            "pipeline.microbatches=8",
            "train.global_batch_size=64",
        ),
    ],
)
def test_estimate_is_within_30_percent_of_the_compiled_step(make_cfg, overrides):
    cfg = make_cfg(
        "model_name=small", "train.seq_len=128", "train.global_batch_size=16", *overrides
    )
    estimated = memory.estimate(cfg, num_devices=8).total
    measured = compiled_bytes_per_device(cfg)
    assert 0.7 < estimated / measured < 1.3, (estimated, measured)


def test_sliding_windows_shrink_the_plain_xla_scores(make_cfg):
    """The plain-XLA kernel of sliding layers scores a band of 2 x window keys per query
    (banded_attention), not the sequence: with every layer sliding, the float32 scores and
    probabilities of a layer shrink from [N, T, T] to [N, T, 2W] per sequence; one global
    layer keeps them whole (the largest layer's count: one layer's at a time)."""
    common = ("model_name=small", "mesh.fsdp=8", "train.seq_len=1024", "train.global_batch_size=8")
    local = ("model.sliding_window=64",)

    def activations(*overrides):
        return memory.estimate(make_cfg(*common, *overrides), num_devices=8).activations

    plain = activations()
    windowed = activations("model.layers=[sliding-dense]", *local)
    rows, heads, t, w = 1, 4, 1024, 64  # a sequence per device, small's 4 heads
    assert plain - windowed == 2 * 4 * rows * heads * t * (t - 2 * w)
    assert activations("model.layers=[sliding-dense*3, global-dense]", *local) == plain


def test_in_schedule_tables_keep_less_than_gpipe_and_one_micro_batch_of_logits(make_cfg):
    """GPipe's backward keeps R x M + S - 1 passes of a micro-batch's layer inputs, 1F1B those
    of the units in flight (at most S): less at every M. 1F1B's head takes one micro-batch at a
    time on the last stage, GPipe's 1/S of the batch on each stage."""
    common = ("model_name=small", "mesh.stage=2", "mesh.fsdp=4", "train.global_batch_size=64")

    def estimate(schedule, microbatches):
        overrides = (f"pipeline.schedule={schedule}", f"pipeline.microbatches={microbatches}")
        return memory.estimate(make_cfg(*common, *overrides), num_devices=8)

    for microbatches in (2, 4, 8):
        gpipe, one_f_one_b = estimate("gpipe", microbatches), estimate("1f1b", microbatches)
        assert one_f_one_b.activations < gpipe.activations, microbatches
        rows, seq_len, vocab, bf16 = 64 // 4, 32, 2048, 2  # small's vocabulary
        assert gpipe.logits == 2 * rows * seq_len // 2 * vocab * bf16
        assert one_f_one_b.logits == 2 * rows * seq_len // microbatches * vocab * bf16


def test_parameter_shards_follow_the_mesh(make_cfg):
    replicated = memory.estimate(make_cfg("mesh.fsdp=1", "mesh.data=8"), num_devices=8)
    sharded = memory.estimate(make_cfg("mesh.fsdp=8"), num_devices=8)
    # tiny: every kernel and the embedding divide by 8 on their embed dim; norms replicate.
    norms = (2 * 2 + 1) * 64 * 4
    assert sharded.params == (replicated.params - norms) // 8 + norms
    assert replicated.optimizer == 2 * replicated.params


@pytest.mark.parametrize(
    "device, devices, memory_gib",
    [("TPU v5e", 8, 16.0), ("TPU v5e", 4, 16.0), ("NVIDIA H100 80GB HBM3", 4, 80.0)],
)
def test_dry_run_says_whether_it_fits_the_named_device_and_by_how_much(
    device, devices, memory_gib, capsys
):
    """llama3-8b over 8 v5e chips fits their 16 GiB (vendor spec) with ~0.6 GiB to spare; over 4
    it does not, and the JSON says by how much; on 4 H100s (80 GiB) it fits."""
    argv = [
        str(CONFIGS_DIR / "base.yml"),
        "model_name=llama3-8b",
        "--dry-run",
        f"--devices={devices}",
    ]
    assert load_tool("benchmark").main([*argv, f"--device={device}"]) == 0
    result = json.loads(capsys.readouterr().out)
    total = result["estimated_gib_per_device"]["total"]
    assert result["fit"] == {
        "device": device,
        "device_memory_gib": memory_gib,
        "fits": total <= memory_gib,
        "headroom_gib": pytest.approx(memory_gib - total, abs=1e-3),
    }
    assert result["fit"]["fits"] == (device != "TPU v5e" or devices == 8)


def test_muon_keeps_one_moment_per_matrix_and_counts_newton_schulz(make_cfg):
    """tiny, replicated: Muon drops one of AdamW's two moments for every layer matrix (q, o
    64x64; k, v 64x32; gate, up, down 64x128; two layers), and its working set is the largest
    stacked matrix's: no device shares a matrix, so each orthogonalises both layers' 64x128 MLP
    kernels, twice (the iterate and the next)."""
    replicated = ("mesh.fsdp=1", "mesh.data=8")
    adamw = memory.estimate(make_cfg(*replicated), num_devices=8)
    muon = memory.estimate(make_cfg(*replicated, "optim.name=muon"), num_devices=8)
    matrices = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) * 4
    assert muon.optimizer == adamw.optimizer - matrices
    assert muon.optimizer_scratch == 2 * 2 * 64 * 128 * 4
    assert adamw.optimizer_scratch == 0


def test_muon_deals_llama3_8b_over_256_devices_one_matrix_each(make_cfg):
    """recipes/tpu-v5e/llama3-8b.yml with Muon on 256 devices (fsdp 256): each of the 32 layers'
    4096 x 14336 MLP matrices is shared by all 256, so a device orthogonalises at most one,
    whole: twice its 224 MiB of scratch, against 32 layers twice (18 GiB) gathered whole."""
    cfg = config_lib.load(REPO_ROOT / "recipes/tpu-v5e/llama3-8b.yml", ["optim.name=muon"])
    scratch = memory.estimate(cfg, num_devices=256).optimizer_scratch
    assert scratch == 2 * 4096 * 14336 * 4 < 2**30


def test_the_pre_flight_refuses_beyond_the_margin_and_the_override_skips_it(make_cfg, monkeypatch):
    """The estimate against the host's RAM (every CPU device of the process shares it): a run
    over MARGIN x the RAM is refused, one under it passes, and run.check_memory=false skips
    the check whatever the estimate."""
    from maxtrain.analysis import preflight

    cfg = make_cfg()
    per_device = memory.estimate(cfg, jax.device_count()).total
    needed = per_device * jax.local_device_count()  # 8 simulated CPU devices (conftest.py)
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: int(needed / 1.2))
    preflight.check_memory(cfg)  # over the RAM, within the margin: starts
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: int(needed / 1.4))
    with pytest.raises(preflight.OutOfMemory, match=r"shared by its 8 CPU devices"):
        preflight.check_memory(cfg)
    preflight.check_memory(make_cfg("run.check_memory=false"))


def test_dry_run_fit_on_cpu_is_the_hosts_ram_shared_by_the_devices(monkeypatch):
    """--dry-run --device cpu: the host's RAM split over the run's simulated devices (it used
    to say "memory not known"); an accelerator keeps its own memory."""
    from maxtrain.benchmarks import step as benchmark

    monkeypatch.setattr(benchmark, "host_memory_bytes", lambda: 8 * 2**30)
    fit = benchmark._fit(3.0, "cpu", 2)
    assert (fit["device_memory_gib"], fit["fits"], fit["headroom_gib"]) == (4.0, True, 1.0)
    assert benchmark._fit(5.0, "cpu", 2)["fits"] is False
    assert benchmark._fit(5.0, "TPU v5 lite", 2)["device_memory_gib"] == 16.0


def test_a_recipe_dry_run_checks_the_chip_it_names(capsys):
    """recipes/tpu-v5e set run.device: --dry-run reports the fit against a v5e chip without
    --device (it printed fits: null, measured against this host's CPU)."""
    from maxtrain.benchmarks import step as benchmark

    recipe = str(REPO_ROOT / "recipes" / "tpu-v5e" / "llama3-8b.yml")
    assert benchmark.main([recipe, "--dry-run", "--devices", "256"]) == 0
    fit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fit"]
    assert (fit["device"], fit["device_memory_gib"], fit["fits"]) == ("TPU v5 lite", 16.0, True)
