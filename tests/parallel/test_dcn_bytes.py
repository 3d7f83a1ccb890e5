"""Which collectives cross slices, read from the compiled program, and what stages save on DCN.

Two simulated slices of 4 CPU devices each (mesh.num_slices=2). Splitting the layers into two
stages over the slices (mesh.dcn.stage=2) sends only micro-batch activations between them;
splitting the batch over the slices (mesh.dcn.data=2) sends every gradient. The bounds below
follow from the shapes alone, not from a measurement.
"""

import jax

from maxtrain import config as config_lib
from maxtrain.analysis.collectives import collective_bytes, device_groups
from maxtrain.data.streams import data_streams
from maxtrain.models import param_count
from maxtrain.parallel import schedules
from maxtrain.parallel.mesh import device_slices
from maxtrain.training.trainer import build_trainer

SLICES = [0, 0, 0, 0, 1, 1, 1, 1]


def test_device_groups_read_every_form_hlo_writes():
    assert device_groups("channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}") == [
        [0, 1],
        [2, 3],
    ]
    # iota form: arange(8) reshaped to [2,2,2], transposed (1,0,2), read as 4 groups of 2
    assert device_groups("replica_groups=[4,2]<=[2,2,2]T(1,0,2), to_apply=%add") == [
        [0, 1],
        [4, 5],
        [2, 3],
        [6, 7],
    ]
    assert device_groups("replica_groups=[2,4]<=[8], use_global_device_ids=true") == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert device_groups("source_target_pairs={{0,4},{4,0}}") == [[0, 4], [4, 0]]
    assert device_groups("replica_groups={}, to_apply=%add") is None


def test_a_collective_counts_as_dcn_only_when_a_group_spans_slices():
    hlo = """ENTRY %main (p: f32[256]) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  %inside = f32[256]{0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %across = f32[256]{0} all-reduce(%inside), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  ROOT %permute = f32[256]{0} collective-permute(%across), source_target_pairs={{0,1},{1,0}}
}"""
    assert collective_bytes(hlo, SLICES) == {
        "all-reduce": 2 * 1024,
        "dcn all-reduce": 1024,  # groups {0,4}, {1,5}, ...: one device in each slice
        "collective-permute": 1024,
    }
    assert "dcn all-reduce" not in collective_bytes(hlo)  # no slices given


MODEL = [
    "model_name=tiny",
    "model.num_layers=4",
    "data.kind=synthetic",
    "train.global_batch_size=16",
    "train.seq_len=32",
    "compute.compute_dtype=float32",
    "mesh.num_slices=2",
]


def dcn_bytes(tmp_path, overrides: list[str]) -> tuple[dict[str, int], object]:
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml", [*MODEL, *overrides, f"run.output_dir={tmp_path}"]
    )
    trainer = build_trainer(cfg, abstract=True)
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_sharding),
        next(data_streams(cfg)[0]),
    )
    compiled = trainer.step_fn.lower(trainer.state, batch).compile()
    totals = collective_bytes(compiled.as_text(), device_slices(trainer.mesh, 2))
    return {k[4:]: v for k, v in totals.items() if k.startswith("dcn ")}, cfg


def test_stages_over_slices_send_activations_and_data_over_slices_sends_gradients(tmp_path):
    """With stages over the slices no parameter crosses: the DCN bytes do not change with the
    depth, and are a bounded number of activation blocks. With the batch over the slices every
    gradient crosses: the bytes grow with the depth by at least the added gradient shards."""
    stages = ["mesh.dcn.stage=2", "mesh.fsdp=4", "pipeline.microbatches=2"]
    data = ["mesh.dcn.data=2", "mesh.fsdp=4"]
    staged = {
        layers: dcn_bytes(tmp_path, [*stages, f"model.num_layers={layers}"]) for layers in (4, 8)
    }
    batched = {
        layers: dcn_bytes(tmp_path, [*data, f"model.num_layers={layers}"]) for layers in (4, 8)
    }
    cfg = staged[4][1]
    assert staged[4][0] == staged[8][0]
    added = param_count(batched[8][1].model) - param_count(batched[4][1].model)
    assert sum(batched[8][0].values()) - sum(batched[4][0].values()) >= added * 4 / 4
    # Per device: a micro-batch's activations, [2 rows, 32, D] float32 (16 rows over 2
    # micro-batches and fsdp 4); the batch's, twice that. Every iteration (M + S - 1 = 3) shifts
    # one block forward and one back; once per step the last stage's output, the head's inputs
    # and their gradients cross too.
    block = 2 * 32 * cfg.model.emb_dim * 4
    moved = staged[4][0]
    assert moved["collective-permute"] >= 2 * 3 * block
    assert sum(moved.values()) <= 2 * 3 * block + 8 * (2 * block)


def test_an_in_schedule_table_over_slices_sends_its_ticks_blocks_whatever_the_depth(tmp_path):
    """1F1B (the in-schedule tables' executor, parallel/scheduled.py) over the slices: no
    parameter crosses either, and the permutes are the table's: one block per tick that
    shifts forward outputs, one per tick that shifts input gradients back, and at most one per
    micro-batch and one more handing stage 0's input gradients to the embedding."""
    M = 4
    stages = ["mesh.dcn.stage=2", "mesh.fsdp=4", "pipeline.schedule=1f1b"]
    staged = {
        layers: dcn_bytes(
            tmp_path, [*stages, f"pipeline.microbatches={M}", f"model.num_layers={layers}"]
        )
        for layers in (4, 8)
    }
    moved, cfg = staged[4]
    assert moved == staged[8][0]
    assert set(moved) <= {"collective-permute", "all-reduce"}
    block = 1 * 32 * cfg.model.emb_dim * 4  # 16 rows over 4 micro-batches and fsdp 4, float32
    phases = schedules.build("1f1b", 2, 1, M).phases()
    shifts = sum(end - start for start, end, kinds in phases for kind in kinds)
    assert shifts * block <= moved["collective-permute"] <= (shifts + M + 1) * block + 64
