"""Throughput accounting and metric sinks: FLOPs per token, MFU, JSONL/TensorBoard, console line.

Why this module exists: "is the run fast?" only has an answer against a fixed yardstick. We use
*model* FLOPs (what the architecture needs per token, the PaLM / "6ND" convention), not hardware
FLOPs, so remat recomputation and kernel choice change the step time but never the FLOP count,
and MFU stays comparable across configs and across frameworks that quote the same convention.
The per-part counts are small separate functions so a mixture-of-experts model can substitute
its *active* MLP parameters without touching the rest.

Metrics go to ``run_dir/metrics.jsonl`` (one flushed JSON object per write, so a crash loses
nothing already logged and any tool can read it) and to TensorBoard; only the writer process
(process 0) writes, and the caller decides which process that is.
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import IO, Any

import numpy as np

from maxtrain.common import devices
from maxtrain.common.files import write_atomic
from maxtrain.config import ModelConfig
from maxtrain.layers.attention import AttentionCounts
from maxtrain.layers.attention_pattern import keys_per_query
from maxtrain.layers.attention_types import attention_type, mixer_counts
from maxtrain.models.stacks import is_moe_per_layer

# ---- FLOP counting ------------------------------------------------------------------------


def attention_proj_params(model: ModelConfig) -> int:
    """Per-layer projection weights of the attention, as its kind declares them."""
    return attention_type(model).counts(model).matmul_params


def mixer_counts_per_layer(model: ModelConfig) -> list[AttentionCounts]:
    """Per model layer: its token mixer's costs (attention's, or a linear layer's)."""
    return [mixer_counts(model, model.layer_mixer(i)) for i in range(model.num_layers)]


def mlp_params(model: ModelConfig) -> int:
    """Per-layer SwiGLU weights of a dense layer: gate and up (emb -> mlp), down (mlp -> emb);
    0 for a model without dense layers."""
    return 3 * model.emb_dim * (model.mlp_dim or 0)


def active_moe_params(model: ModelConfig) -> int:
    """Weights one token multiplies against in an MoE layer: the router, its top-k routed
    experts and the shared experts. The other experts' weights are idle for that token, so
    they count toward the total parameters but never toward FLOPs or MFU."""
    m = model.moe
    assert m is not None
    expert = 3 * model.emb_dim * m.expert_mlp_dim
    shared_gate = model.emb_dim if m.shared_expert_gate else 0
    return model.emb_dim * m.num_experts + (m.top_k + m.shared_experts) * expert + shared_gate


def head_params(model: ModelConfig) -> int:
    """The LM head (emb -> vocab). Counted even with tied embeddings: it is a matmul either way.

    The input embedding is a gather, not a matmul, so it never enters the FLOP count.
    """
    return model.vocab_size * model.emb_dim


def matmul_params(model: ModelConfig) -> int:
    """Parameters each token multiplies against: all layers' projections and MLPs (active
    experts only) plus the head.

    Excludes the input embedding lookup and norm scales (including qk-norm), which are not
    matmuls.
    """
    ffn = sum(
        active_moe_params(model) if is_moe else mlp_params(model)
        for is_moe in is_moe_per_layer(model)
    )
    mixers = sum(counts.matmul_params for counts in mixer_counts_per_layer(model))
    layers = mixers + ffn + head_params(model)
    return layers + model.mtp.depth * mtp_module_matmul_params(model)


def mtp_module_matmul_params(model: ModelConfig) -> int:
    """One multi-token prediction module (models/mtp.py): its 2D -> D projection, a block of
    the last layer's kind, and the shared head it runs again."""
    last_is_moe = is_moe_per_layer(model)[-1]
    ffn = active_moe_params(model) if last_is_moe else mlp_params(model)
    projection = 2 * model.emb_dim * model.emb_dim
    return projection + attention_proj_params(model) + ffn + head_params(model)


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the score (QK^T) and value (AV) matmuls, causal.

    Forward: 2 FLOPs/MAC x the keys a query attends to x (the scores' width N x H_qk plus the
    values' N x H_v) per token per layer. The causal mask halves a global layer's keys (the
    standard, mask-aware count), leaving seq_len x (N H_qk + N H_v), 2 x seq_len x N x H when
    both head sizes are H; a local layer attends to its window or chunk only
    (attention_pattern.keys_per_query). A linear layer attends to no keys: its recurrence's
    FLOPs per token, the same at any seq_len, count instead. Training is 3x the forward
    (backward = 2x forward).
    """
    counts = attention_type(model).counts(model)
    # MTP: a block each, of global attention
    keys = sum(keys_per_query(model, seq_len)) + model.mtp.depth * seq_len / 2
    recurrence = sum(c.recurrence_flops for c in mixer_counts_per_layer(model))
    return 6.0 * keys * (counts.qk_width + counts.v_width) + 3.0 * recurrence


def train_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs to train on one token (forward + backward), the MFU numerator.

        flops/token = 6 * P_matmul + 6 * L * seq_len * N * H

    where P_matmul is ``matmul_params`` (weights a token multiplies against: 2 FLOPs per MAC
    forward, 4 backward, hence 6 -- the "6ND" rule of Kaplan et al. and PaLM appendix B) and the
    second term is causal self-attention over ``seq_len`` (see ``attention_flops_per_token``;
    PaLM's 6*L*H*(2Q)*T counts the full mask, we count the causal half as most frameworks now do;
    local layers count their window's or chunk's keys instead).
    Recomputation from remat is deliberately NOT counted: these are model FLOPs, not hardware
    FLOPs, so MFU does not reward recomputing activations.
    """
    return 6.0 * matmul_params(model) + attention_flops_per_token(model, seq_len)


# ---- peak throughput --------------------------------------------------------------------------


def peak_tflops(device_kind: str) -> float | None:
    """Peak dense bf16 TFLOP/s of one device, the MFU denominator (the chip table,
    maxtrain/common/devices.py), or None when unknown (CPU): MFU is not reported."""
    chip = devices.chip(device_kind)
    return None if chip is None else chip.peak_flops["bf16"] / 1e12


# ---- step statistics --------------------------------------------------------------------------


def step_stats(
    step_time_s: float,
    tokens_per_step: int,
    num_devices: int,
    flops_per_token: float,
    peak_tflops_per_device: float | None,
) -> dict[str, float | None]:
    """Throughput of one optimizer step: tokens/s and TFLOP/s per device, and MFU (0..1).

    ``tokens_per_step`` is global (all devices); ``mfu`` is None when the peak is unknown.
    """
    tokens_per_sec_per_device = tokens_per_step / step_time_s / num_devices
    tflops_per_device = tokens_per_sec_per_device * flops_per_token / 1e12
    mfu = None if peak_tflops_per_device is None else tflops_per_device / peak_tflops_per_device
    return {
        "tokens_per_sec_per_device": tokens_per_sec_per_device,
        "tflops_per_device": tflops_per_device,
        "mfu": mfu,
    }


# ---- writers ----------------------------------------------------------------------------------


def _to_number(value: Any) -> int | float:
    """Python int/float from a Python, NumPy or 0-d JAX scalar (JSON cannot hold the others)."""
    dtype = getattr(value, "dtype", None)
    if isinstance(value, numbers.Integral) or (dtype is not None and dtype.kind in "iub"):
        return int(value)
    return float(value)


class MetricsWriter:
    """Appends scalars to ``run_dir/metrics.jsonl`` and TensorBoard; a no-op unless is_writer.

    ``is_writer`` is required (pass ``jax.process_index() == 0``) so that multi-host runs never
    have every process appending to the same file by accident.

    ``start_step``: the step the run starts from (the restored checkpoint's, 0 for a fresh run).
    A run that was stopped after its last checkpoint logged steps it will now train again;
    their records are dropped first (``drop_records_after``), so the file keeps one record per
    step, the newest run's. TensorBoard's own event files are append-only: the new ones start
    with a purge marker at ``start_step + 1``, which makes TensorBoard hide the older events
    from that step on (they stay on disk).
    """

    def __init__(
        self,
        run_dir: str | Path,
        enable_tensorboard: bool = True,
        *,
        is_writer: bool,
        start_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.is_writer = is_writer
        self._jsonl: IO[str] | None = None
        self._tb: Any = None
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if start_step is not None:
            drop_records_after(path, start_step)
        self._jsonl = path.open("a", encoding="utf-8")
        if enable_tensorboard:
            from tensorboardX import SummaryWriter

            # A skipped non-finite step logs its NaN loss on purpose, and the train loop warns
            # about it once; tensorboardX would add a warning per NaN scalar.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
            purge = start_step + 1 if start_step else None
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

    def write(self, step: int, scalars: dict[str, float | int | None], prefix: str) -> None:
        """One JSON line {"step": step, "<prefix>/<key>": value, ...}; None values are skipped."""
        if self._jsonl is None:
            return
        record: dict[str, int | float] = {"step": int(step)}
        for key, value in scalars.items():
            if value is not None:
                record[f"{prefix}/{key}" if prefix else key] = _to_number(value)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for tag, value in record.items():
                if tag != "step":
                    self._tb.add_scalar(tag, value, int(step))
            self._tb.flush()

    def write_histograms(self, step: int, arrays: dict[str, Any], prefix: str) -> None:
        """Per-layer distributions, e.g. expert load [layers, experts]: one JSON line with the
        nested lists, and one TensorBoard histogram per layer (`<prefix>/<key>/layer<i>`)."""
        if self._jsonl is None:
            return
        record: dict[str, Any] = {"step": int(step)}
        for key, value in arrays.items():
            rows = np.asarray(value, dtype=np.float64)
            record[f"{prefix}/{key}"] = rows.round(6).tolist()
            if self._tb is not None:
                for i, row in enumerate(rows):
                    self._tb.add_histogram(f"{prefix}/{key}/layer{i}", row, int(step))
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record_step(line: bytes) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line torn by a kill mid-write


def drop_records_after(path: Path, step: int) -> int:
    """Removes the records of steps after `step` from a metrics.jsonl (and any torn line);
    returns how many. The kept records are written to a temporary file renamed over the old
    one, so a crash here leaves the old file or the new one, never a mix."""
    if not path.exists():
        return 0
    with path.open("rb") as f:
        dropped = sum(1 for line in f if (s := _record_step(line)) is None or s > step)
    if dropped:

        def kept(out: IO[bytes]) -> None:
            with path.open("rb") as f:
                for line in f:
                    if (s := _record_step(line)) is not None and s <= step:
                        out.write(line if line.endswith(b"\n") else line + b"\n")

        write_atomic(path, kept)
    return dropped


# ---- console ----------------------------------------------------------------------------------


def _si(value: float) -> str:
    """12400 -> '12.4k', 1.5e6 -> '1.50M', 950 -> '950'."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def _hms(seconds: float) -> str:
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_console_line(step: int, total_steps: int, scalars: dict[str, Any]) -> str:
    """One compact progress line; each piece is shown only when its scalar is present.

    Reads ``loss``, ``lr``, ``grad_norm``, ``step_time_s`` (seconds), and the ``step_stats``
    keys ``tokens_per_sec_per_device``, ``tflops_per_device``, ``mfu`` (fraction, shown as %),
    and an MoE model's ``moe/max_load``, ``moe/rounds`` and ``moe/dropped`` (when any), and
    GRPO's ``rollout/reward``, ``grpo/kl``, ``grpo/clipped`` and ``rollout/rollout_share``.
    ETA = (total_steps - step) * step_time_s.
    """
    width = max(5, len(str(total_steps)))
    parts = [f"step {step:>{width}}/{total_steps}"]
    get = scalars.get
    if (loss := get("loss")) is not None:
        parts.append(f"loss {float(loss):.4f}")
    if (lr := get("lr")) is not None:
        parts.append(f"lr {float(lr):.1e}")
    if (gnorm := get("grad_norm")) is not None:
        parts.append(f"gnorm {float(gnorm):.3f}")
    step_time = get("step_time_s")
    if step_time is not None:
        parts.append(f"{float(step_time) * 1e3:.1f} ms")
    if (tok := get("tokens_per_sec_per_device")) is not None:
        parts.append(f"{_si(float(tok))} tok/s/dev")
    if (tflops := get("tflops_per_device")) is not None:
        # Three significant digits: a CPU's 0.0004 TFLOP/s is not "0.0", an H100's reads 491.
        parts.append(f"{float(tflops):.3g} TFLOP/s/dev")
    if (mfu := get("mfu")) is not None:
        parts.append(f"MFU {float(mfu) * 100:.1f}%")
    if (max_load := get("moe/max_load")) is not None:
        moe = f"moe max_load {float(max_load):.2f} rounds {float(get('moe/rounds', 1)):.3g}"
        if dropped := float(get("moe/dropped", 0)):
            moe += f" dropped {dropped * 100:.2f}%"
        parts.append(moe)
    if (reward := get("rollout/reward")) is not None:  # GRPO's (maxtrain/posttrain/rollout.py)
        grpo = (
            f"reward {float(reward):.3f} kl {float(get('grpo/kl', 0)):.2e} "
            f"clipped {float(get('grpo/clipped', 0)):.3f}"
        )
        if (share := get("rollout/rollout_share")) is not None:  # none before a cycle ends
            grpo += f" sampling {float(share) * 100:.0f}%"
        parts.append(grpo)
    if step_time is not None:
        parts.append(f"ETA {_hms(max(0, total_steps - step) * float(step_time))}")
    return " | ".join(parts)


def drop_warning(dropped: float, limit: float = 0.01) -> str | None:
    """A warning when the MoE layers dropped more than `limit` of their assignments (mean over
    the steps of a log window), else None."""
    if dropped <= limit:
        return None
    return (
        f"MoE layers dropped {dropped:.1%} of their routed assignments over the last log window: "
        "raise model.moe.expert_capacity_factor or compute.expert_exchange_capacity, or set "
        "compute.expert_exchange_overflow=rounds (dropless)"
    )
