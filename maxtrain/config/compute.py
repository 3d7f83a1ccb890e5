"""The `compute:` section: how a run computes its model, never what it computes. The dtypes,
the layer loop, the kernels and the exchanges between devices: each may change between the
slices of one run (training/run_identity.py compares `model:`, never this), and each "auto" is
made concrete for the devices the program is built for (models/build.py platform_choices).
"""

from __future__ import annotations

from typing import Literal

from maxtrain.config.attention_kernels import ATTENTION_CHOICES
from maxtrain.config.domains import PositiveFloat, PositiveInt, Section


class KernelTiles(Section):
    """One grouped matmul kernel's tiles: fields of the platform's tokamax kernel config, null
    for tokamax's choice (its autotuning cache for the exact shape, else its heuristics).
    models/build.py platform_choices checks them against the kernel of the devices' platform."""

    # TPU (tokamax's Mosaic TPU kernel): rows, contraction and output columns per tile, and the
    # input buffers its pipeline keeps.
    tile_m: PositiveInt | None = None
    tile_k: PositiveInt | None = None
    tile_n: PositiveInt | None = None
    input_buffer_count: PositiveInt | None = None
    # GPU (tokamax's Mosaic GPU kernel; the first five are named together): the output block,
    # its contraction step, the software pipeline's stages, the contraction's split, and how
    # many blocks wide the grid walks.
    block_m: PositiveInt | None = None
    block_n: PositiveInt | None = None
    block_k: PositiveInt | None = None
    num_stages: PositiveInt | None = None
    split_k: PositiveInt | None = None
    grid_tile_width: PositiveInt | None = None

    def named(self) -> dict[str, int]:
        return {field: value for field, value in self if value is not None}


class ProjectionTiles(Section):
    """A projection's tiles per pass: its product, and the gradients of its rows and weights,
    each a kernel of its own."""

    forward: KernelTiles = KernelTiles()
    input_grad: KernelTiles = KernelTiles()
    weight_grad: KernelTiles = KernelTiles()


def named_tiles(tiles: dict[str, ProjectionTiles]) -> dict[str, dict[str, dict[str, int]]]:
    """{projection: {pass: {field: value}}} of the tiles named in compute.grouped_matmul_tiles,
    nothing else."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for projection, passes in tiles.items():
        for name, kernel in passes:
            if fields := kernel.named():
                out.setdefault(projection, {})[name] = fields
    return out


# The attention kernels by name (attention_kernels.py): auto, mosaic, or one kernel.
AttentionKernel = Literal[ATTENTION_CHOICES]


class ComputeConfig(Section):
    """How the model is computed: dtypes, kernels, exchanges and diagnostics. Besides float
    rounding, only a diagnostic (balanced_routing) or a dropping exchange
    (expert_exchange_overflow drop) changes what the model computes; the schema holds the
    defaults (configs/reference.yml)."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"  # parameters and optimizer state
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 off CPU
    scan_layers: bool = True  # the layers under lax.scan: compile time independent of depth
    remat: Literal["none", "full", "minimal"] = "full"  # what the backward pass recomputes
    attention: AttentionKernel = "auto"
    # Each attention head's largest pre-softmax logit over the step's batch, as a statistic
    # (metric attention/max_logit; QK-clip reads it: optim.qk_clip_threshold turns it on).
    # Only the xla kernel computes it (kernels/xla_attention.py).
    attention_max_logit: bool = False
    # With mesh.context > 1 (parallel/context.py): how keys/values reach the queries,
    # and how the sequence is cut over the devices.
    context_exchange: Literal["all_gather", "ring"] = "all_gather"
    context_layout: Literal["balanced", "contiguous"] = "balanced"
    # The experts' grouped matmul (kernels/grouped_matmul.py); auto: tokamax on GPU/TPU.
    grouped_matmul: Literal["auto", "xla", "tokamax"] = "auto"
    # tokamax's tiles for each projection (gate_up, down) and pass (forward, input_grad,
    # weight_grad); unnamed: tokamax's choice. The xla grouped matmul has no tiles.
    grouped_matmul_tiles: dict[Literal["gate_up", "down"], ProjectionTiles] = {}
    # Dropless experts split over devices (mesh.expert > 1): how rows reach their experts
    # (parallel/expert_exchanges.py). auto: ragged on GPU/TPU, all_to_all elsewhere.
    expert_exchange: Literal["auto", "all_to_all", "ragged", "all_gather"] = "auto"
    # Its buffers hold this many times the routed rows per round (>= mesh.expert: one round,
    # worst-case buffers, P times the traffic).
    expert_exchange_capacity: PositiveFloat = 1.25
    # What does not fit: rounds = sent in further rounds, nothing dropped (moe/rounds);
    # drop = dropped (moe/dropped), one round.
    expert_exchange_overflow: Literal["rounds", "drop"] = "rounds"
    # A diagnostic, not a way to train: every expert gets the same number of each device's
    # assignments (token n's j-th choice is expert (n k + j) mod E, weighted by the router's
    # scores for it), so a benchmark measures the step under the routing peers publish figures
    # for. The learned routing's imbalance is what it removes (moe/max_load, moe/rounds).
    balanced_routing: bool = False
