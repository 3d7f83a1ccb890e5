"""1F1B's activation memory against GPipe's, read from the compiled train step's temporaries
(XLA's memory analysis): 2 stages, M = 4S = 8 micro-batches, 8 simulated CPU devices (stage 2
x fsdp 4), compiled from shapes only (nothing runs)."""

from maxtrain import config as config_lib
from maxtrain.training.trainer import build_trainer, compile_step

S, M = 2, 8


def temporaries(schedule: str, out, layers: int = 8, seq_len: int = 32, microbatches: int = M):
    """Bytes of temporaries per device of the tiny model's train step under `schedule`, for 4
    rows a micro-batch (the test's case by default; docs/pipeline.md's table prints others).

    4 layers a stage: a stage's kept inputs, which the schedules differ in, outweigh the one
    layer's working set and the gradients, which both hold alike (with one layer a stage the
    kept inputs are a few percent of the temporaries, and 1F1B's are the larger)."""
    overrides = [
        "model_name=tiny", f"model.num_layers={layers}", "data.kind=synthetic",
        f"train.global_batch_size={4 * microbatches}", f"train.seq_len={seq_len}",
        "checkpoint.enabled=false", f"mesh.stage={S}", "mesh.fsdp=4",
        f"pipeline.schedule={schedule}", f"pipeline.microbatches={microbatches}",
        f"run.output_dir={out}",
    ]  # fmt: skip
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
    compiled, _, _ = compile_step(build_trainer(cfg, abstract=True))
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_keeps_at_most_half_gpipes_temporaries_at_M_4S(tmp_path):
    """GPipe's derivative of its tick scan keeps each tick's layer inputs (M + S - 1 of them a
    layer) and a copy of the stage's weight shards per tick; 1F1B keeps the inputs of the
    micro-batches in flight, at most 2 S - 1 on the first stage whatever M
    (docs/pipeline.md)."""
    gpipe, one_f_one_b = temporaries("gpipe", tmp_path), temporaries("1f1b", tmp_path)
    assert one_f_one_b <= 0.5 * gpipe, (one_f_one_b, gpipe)
