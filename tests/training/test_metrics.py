"""FLOP counts against hand arithmetic, the peak table, step stats, writers and the console line."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from maxtrain.config import LinearAttention, ModelConfig
from maxtrain.training.metrics import (
    MetricsWriter,
    drop_warning,
    format_console_line,
    matmul_params,
    peak_tflops,
    step_stats,
    train_flops_per_token,
)


def _small(**overrides: object) -> ModelConfig:
    kwargs: dict[str, object] = dict(
        vocab_size=1000, emb_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


# ---- FLOPs ------------------------------------------------------------------------------------


def test_small_model_flops_match_hand_count() -> None:
    model = _small()  # head_dim = 64 / 4 = 16
    q = 64 * 4 * 16  # 4096
    k = 64 * 2 * 16  # 2048
    v = 64 * 2 * 16  # 2048
    o = 4 * 16 * 64  # 4096
    mlp = 3 * 64 * 128  # 24576
    head = 1000 * 64  # 64000
    params = 2 * (q + k + v + o + mlp) + head
    assert params == 137_728
    assert matmul_params(model) == params

    attn = 6 * 32 * 4 * 16 * 2  # 6 * seq * heads * head_dim * layers = 24576
    assert train_flops_per_token(model, seq_len=32) == 6 * params + attn == 850_944


def test_tied_embeddings_do_not_change_flops() -> None:
    untied = _small(tie_embeddings=False)
    tied = _small(tie_embeddings=True)
    assert matmul_params(tied) == matmul_params(untied)
    assert train_flops_per_token(tied, 32) == train_flops_per_token(untied, 32)


def test_qk_norm_does_not_change_flops() -> None:
    assert train_flops_per_token(_small(qk_norm="rms"), 32) == train_flops_per_token(_small(), 32)


def test_explicit_head_dim_is_used() -> None:
    model = _small(head_dim=32)  # qwen-like: head_dim != emb_dim / num_heads (16)
    q = 64 * 4 * 32  # 8192
    k = 64 * 2 * 32  # 4096
    v = 64 * 2 * 32  # 4096
    o = 4 * 32 * 64  # 8192
    mlp = 3 * 64 * 128  # 24576
    head = 1000 * 64
    params = 2 * (q + k + v + o + mlp) + head
    assert params == 162_304
    assert matmul_params(model) == params
    attn = 6 * 32 * 4 * 32 * 2  # 49152
    assert train_flops_per_token(model, 32) == 6 * params + attn == 1_022_976


@pytest.mark.parametrize(
    "local, local_keys",
    [
        # a window of 16 over 64 tokens: 16 keys per query once full, its triangle over the
        # first 16 queries: 16 - 16^2 / (2 x 64)
        (dict(sliding_window=16), 14.0),
        # chunks of 24: two full ones and one of 16, each triangle c^2 / 2, over 64 queries
        (dict(attention_chunk=24), (2 * 24**2 / 2 + 16**2 / 2) / 64),
        (dict(sliding_window=64), 32.0),  # a window covering the sequence is global
    ],
)
def test_local_layers_count_their_window_or_chunk_not_the_sequence(local, local_keys) -> None:
    """A sliding (chunked) layer's attention matmuls run over its window's (chunk's) keys: the
    FLOP count of [local, global] x 2 is the global model's less the two local layers' missing
    keys, 6 FLOPs x (N H_qk + N H_v) each; the projections count the same."""
    plain = _small(num_layers=4)
    kind = "sliding" if "sliding_window" in local else "chunked"
    windowed = _small(num_layers=4, layers=[f"{kind}-dense", "global-dense"], **local)
    assert matmul_params(windowed) == matmul_params(plain)
    per_key = 6 * (4 * 16 + 4 * 16)  # per layer and token: N x H for the scores, for the values
    global_keys = 64 / 2  # the causal half
    saved = 2 * (global_keys - local_keys) * per_key
    assert train_flops_per_token(windowed, 64) == pytest.approx(
        train_flops_per_token(plain, 64) - saved, rel=1e-12
    )


def test_linear_layers_count_their_own_projections_and_recurrence_not_keys() -> None:
    """A Gated DeltaNet layer multiplies against its own projections (q, k of 2 heads x 8; v,
    z of 4 x 6; b, a; o) and convolution taps, not attention's, and attends to no keys: its
    FLOPs per token are the same at any seq_len, 3 x 2 x 3 dk dv per value head for the
    recurrence (S k, S q and the rank-one write)."""
    linear = LinearAttention(
        num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4
    )
    hybrid = _small(layers=["linear-dense", "global-dense"], linear_attention=linear)
    d, key, value = 64, 2 * 8, 4 * 6
    projections = d * (2 * key + 2 * value) + 2 * d * 4 + value * d + 4 * (2 * key + value)
    attention = 2 * 64 * 4 * 16 + 2 * 64 * 2 * 16  # q and o, k and v: the global layer's
    assert matmul_params(hybrid) == projections + attention + 2 * 3 * 64 * 128 + 1000 * 64
    recurrence = 3 * 2 * 3 * 4 * 8 * 6
    for seq_len in (32, 4096):
        keys = 6 * (seq_len / 2) * (4 * 16 + 4 * 16)  # the global layer's only
        assert train_flops_per_token(hybrid, seq_len) == pytest.approx(
            6 * matmul_params(hybrid) + keys + recurrence, rel=1e-12
        )


def test_llama3_8b_matches_quoted_parameter_count() -> None:
    model = ModelConfig(
        vocab_size=128256,
        emb_dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14336,
    )
    # Llama-3-8B is quoted at ~8.03B parameters; the input embedding (128256 * 4096) is a
    # lookup, not a matmul. The remainder (all but ~0.26M of norm scales) is the matmul count.
    quoted_total = 8.03e9
    input_embedding = 128256 * 4096  # 525,336,576
    expected_params = quoted_total - input_embedding
    assert matmul_params(model) == pytest.approx(expected_params, rel=1e-3)

    attn = 6 * 8192 * 32 * 128 * 32  # causal attention at seq 8192
    expected_flops = 6 * expected_params + attn
    assert train_flops_per_token(model, seq_len=8192) == pytest.approx(expected_flops, rel=1e-3)


# ---- peak table -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA B200", 2250.0),
        ("TPU v4", 275.0),
        ("TPU v5 lite", 197.0),
        ("TPU v5e", 197.0),
        ("TPU v5", 459.0),
        ("TPU v5p", 459.0),
        ("TPU v6 lite", 918.0),
        ("tpu v6e", 918.0),
        ("cpu", None),
        ("", None),
    ],
)
def test_peak_tflops(kind: str, peak: float | None) -> None:
    assert peak_tflops(kind) == peak


# ---- step stats -------------------------------------------------------------------------------


def test_step_stats_math() -> None:
    stats = step_stats(
        step_time_s=0.5,
        tokens_per_step=8 * 4096,  # 32768 global tokens
        num_devices=4,
        flops_per_token=1e9,
        peak_tflops_per_device=100.0,
    )
    # 32768 / 0.5 s / 4 devices = 16384 tok/s/dev; * 1e9 FLOP = 16.384 TFLOP/s; / 100 = 16.384%
    assert stats["tokens_per_sec_per_device"] == pytest.approx(16384.0)
    assert stats["tflops_per_device"] == pytest.approx(16.384)
    assert stats["mfu"] == pytest.approx(0.16384)


def test_step_stats_mfu_none_without_peak() -> None:
    stats = step_stats(1.0, 1000, 1, 1e6, None)
    assert stats["tokens_per_sec_per_device"] == pytest.approx(1000.0)
    assert stats["tflops_per_device"] == pytest.approx(1e-3)
    assert stats["mfu"] is None


# ---- writers ----------------------------------------------------------------------------------


def _read_event_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars from a TFRecord event file, without TensorBoard (length, crc, data, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        record = data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4
        event = Event.FromString(record)
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_metrics_writer_jsonl_and_tensorboard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, is_writer=True)
    writer.write(10, {"loss": 3.5, "lr": 1e-4, "mfu": None, "tokens": 4096}, prefix="train")
    writer.write(20, {"loss": 3.25}, prefix="eval")
    writer.close()

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == [
        {"step": 10, "train/loss": 3.5, "train/lr": 1e-4, "train/tokens": 4096},
        {"step": 20, "eval/loss": 3.25},
    ]
    assert list(records[0])[0] == "step"
    assert isinstance(records[0]["train/tokens"], int)

    events = list((run_dir / "tensorboard").glob("events.out.tfevents*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    scalars = _read_event_scalars(events[0])
    assert "train/mfu" not in scalars
    assert scalars["train/loss"] == [(10, 3.5)]
    assert scalars["eval/loss"] == [(20, 3.25)]
    assert math.isclose(scalars["train/lr"][0][1], 1e-4, rel_tol=1e-6)


def test_metrics_writer_appends_and_flushes_each_line(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path, enable_tensorboard=False, is_writer=True) as writer:
        writer.write(1, {"loss": 2.0}, prefix="train")
        # Flushed before close: a crash here would not lose the line.
        assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
            "step": 1,
            "train/loss": 2.0,
        }
    with MetricsWriter(tmp_path, enable_tensorboard=False, is_writer=True) as writer:
        writer.write(2, {"loss": 1.5}, prefix="train")
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "tensorboard").exists()


def test_metrics_writer_accepts_numpy_and_jax_scalars(tmp_path: Path) -> None:
    import jax.numpy as jnp
    import numpy as np

    scalars = {"loss": np.float32(0.5), "n": np.int32(7), "gnorm": jnp.float32(0.25)}
    with MetricsWriter(tmp_path, enable_tensorboard=False, is_writer=True) as writer:
        writer.write(np.int64(3), scalars | {"tokens": jnp.int32(9)}, prefix="train")
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {
        "step": 3,
        "train/loss": 0.5,
        "train/n": 7,
        "train/gnorm": 0.25,
        "train/tokens": 9,
    }
    assert isinstance(record["train/tokens"], int)


def test_a_resumed_writer_drops_the_records_of_steps_it_trains_again(tmp_path: Path) -> None:
    """Killed at step 7 after a checkpoint at step 4 (its last line torn mid-write): the run
    resumed at step 4 logs 5, 6, ... again, so the file keeps 1-4 and then the new records."""
    path = tmp_path / "metrics.jsonl"
    old = [json.dumps({"step": s, "train/loss": float(s)}) for s in range(1, 8)]
    path.write_text("\n".join(old) + '\n{"step": 8, "train/lo')
    with MetricsWriter(tmp_path, enable_tensorboard=False, is_writer=True, start_step=4) as w:
        w.write(5, {"loss": 50.0}, prefix="train")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["train/loss"] == 50.0


def test_metrics_writer_non_writer_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, is_writer=False)
    writer.write(1, {"loss": 1.0}, prefix="train")
    writer.close()
    assert not run_dir.exists()


# ---- console ----------------------------------------------------------------------------------


def _scalars(mfu: float | None) -> dict[str, float | None]:
    return {
        "loss": 3.21041,
        "lr": 2.9e-4,
        "grad_norm": 0.8123,
        "step_time_s": 0.0413,
        "tokens_per_sec_per_device": 12_400.0,
        "tflops_per_device": 0.123,
        "mfu": mfu,
    }


def test_console_line_without_mfu() -> None:
    line = format_console_line(100, 300, _scalars(None))
    assert line == (
        "step   100/300 | loss 3.2104 | lr 2.9e-04 | gnorm 0.812 | 41.3 ms | "
        "12.4k tok/s/dev | 0.123 TFLOP/s/dev | ETA 0:00:08"
    )
    assert "MFU" not in line
    small = format_console_line(1, 300, {**_scalars(None), "tflops_per_device": 4.2e-4})
    assert "| 0.00042 TFLOP/s/dev |" in small  # a CPU's rate, not "0.0"


def test_console_line_with_mfu_and_long_eta() -> None:
    scalars = _scalars(0.4567) | {"step_time_s": 2.0}
    line = format_console_line(0, 10_000, scalars)
    assert "| MFU 45.7% |" in line
    assert line.endswith("ETA 5:33:20")  # 10000 steps * 2 s = 20000 s
    assert line.startswith("step     0/10000 | loss 3.2104")


def test_console_line_shows_grpo_sampling_only_once_measured() -> None:
    """GRPO's sampling share exists from the second rollout on (the first's cycle ends
    there): the first line has none, where it read "sampling 0%"."""
    grpo = {"loss": 1.0, "rollout/reward": 0.5, "grpo/kl": 0.0, "grpo/clipped": 0.0}
    first = format_console_line(1, 5, grpo)
    assert first.endswith("reward 0.500 kl 0.00e+00 clipped 0.000") and "sampling" not in first
    later = format_console_line(2, 5, {**grpo, "rollout/rollout_share": 0.574})
    assert later.endswith("clipped 0.000 sampling 57%")


def test_console_line_shows_moe_load_rounds_and_drops_and_warns_over_1_percent() -> None:
    moe = {"loss": 1.0, "moe/max_load": 3.359, "moe/rounds": 4.0, "moe/dropped": 0.0}
    assert format_console_line(5, 5, moe) == (
        "step     5/5 | loss 1.0000 | moe max_load 3.36 rounds 4"
    )  # dropless: no dropped share to show
    dropping = moe | {"moe/rounds": 1.0, "moe/dropped": 0.0512}
    assert format_console_line(5, 5, dropping).endswith("moe max_load 3.36 rounds 1 dropped 5.12%")
    assert drop_warning(0.01) is None
    assert "dropped 1.1% of their routed assignments" in drop_warning(0.011)


def test_console_line_omits_missing_pieces() -> None:
    line = format_console_line(5, 5, {"loss": 1.0})
    assert line == "step     5/5 | loss 1.0000"
