"""Every TPU path, compiled by the TPU compiler (libtpu) for compile-only devices on this CPU
host (maxtrain/parallel/topology.py): what a v5e slice would run, without one.

Each case builds the run's trainer over a topology's devices from shapes alone, compiles the
train step, and asserts what the compiler's program shows: the configured Pallas kernels are
in it (no silent fallback to plain XLA), and the exchange the path is about moves its bytes
over the mesh axes it should. Sliding windows are read from splash's block tables: the grid its
kernels step through. Cases that read one program compile it once between them (compiled_once):
a TPU compile is the bulk of a case's time.
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxtrain import config as config_lib
from maxtrain.analysis import collectives, program
from maxtrain.config import MeshConfig
from maxtrain.kernels.attention import attention_kernel
from maxtrain.parallel.mesh import build_mesh, mesh_platform, sharding_rules
from maxtrain.parallel.topology import topology_devices
from maxtrain.training import run_model
from maxtrain.training.trainer import build_trainer, compile_step

TOPOLOGY = "v5e:2x2"  # 4 chips; the MoE and context cases fill them with one axis
ATTENTION = ["splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals"]
GROUPED_MATMUL = ["pallas_tpu_ragged_dot_gmm", "pallas_tpu_ragged_dot_tgmm"]
# tokamax's TPU grouped matmul takes matrices at least 128 wide (narrower ones fall back to XLA)
MOE = ("model_name=tiny-moe", "model.emb_dim=128", "model.moe.expert_mlp_dim=128")
# TPU kernels tile 128 tokens a lane: sequences of one tile keep the compiles small.
SMALL = ("train.seq_len=128", "train.global_batch_size=8")


def _compile(make_cfg, *overrides: str, slices: int = 1, remat: str = "none") -> tuple:
    """(trainer, compiled program's text, its kernels) for the run's config on TOPOLOGY.
    Without remat (about a tenth less TPU compile time) unless a case is about what the backward
    pass recomputes: the kernels, tiles, grids and exchanges the cases read are the same either
    way."""
    cfg = make_cfg(*SMALL, f"compute.remat={remat}", *overrides)
    trainer = build_trainer(cfg, devices=list(topology_devices(TOPOLOGY, slices)), abstract=True)
    compiled, _, _ = compile_step(trainer)
    hlo = compiled.as_text()
    found = program.kernels(hlo)
    program.check_kernels(
        trainer.cfg.model, trainer.cfg.compute, found, trainer.mesh.shape["context"]
    )
    return trainer, hlo, found


@pytest.fixture(scope="module")
def compiled_once() -> dict:
    """Programs that several cases read, each compiled by the first case that needs it (a case
    that runs alone, or on another xdist worker, compiles it itself)."""
    return {}


def _compile_once(compiled_once: dict, make_cfg, *overrides: str, remat: str = "none") -> tuple:
    key = (*overrides, remat)
    if key not in compiled_once:
        compiled_once[key] = _compile(make_cfg, *overrides, remat=remat)
    return compiled_once[key]


# Dense under fsdp 2 x tensor 2 with Muon: splash and FSDP's gathers, and Muon's exchange.
FSDP_TENSOR_MUON = ("mesh.fsdp=2", "mesh.tensor=2", "optim.name=muon")


def _collectives(trainer, hlo: str) -> dict[str, int]:
    slices = None
    if trainer.cfg.mesh.num_slices > 1:
        from maxtrain.parallel.mesh import device_slices

        slices = device_slices(trainer.mesh, trainer.cfg.mesh.num_slices)
    per_axis = collectives.collective_bytes_per_axis(hlo, dict(trainer.mesh.shape), slices)
    return {
        f"{net} {key}": moved for net, kinds in per_axis.items() for key, moved in kinds.items()
    }


def _has(found: dict[str, int], names: list[str]) -> None:
    missing = [name for name in names if name not in found]
    assert not missing, f"kernels {missing} not in the program: {found}"


def test_choices_follow_the_devices_not_the_host(make_cfg):
    """On this CPU host a TPU topology's devices get the TPU's kernels and bf16 compute."""
    devices = topology_devices(TOPOLOGY)
    assert devices[0].platform == "tpu" and devices[0].device_kind == "TPU v5 lite"
    trainer = build_trainer(
        make_cfg(*SMALL, "model_name=tiny-moe", "mesh.fsdp=4"), devices=list(devices), abstract=True
    )
    assert mesh_platform(trainer.mesh) == "tpu"
    compute = trainer.cfg.compute
    assert (compute.attention, compute.compute_dtype) == ("splash", "bfloat16")
    assert (compute.grouped_matmul, compute.expert_exchange) == ("tokamax", "ragged")
    host = run_model.for_platform(make_cfg(*SMALL, "model_name=tiny-moe"), "cpu").compute
    assert (host.attention, host.compute_dtype, host.grouped_matmul) == (
        "xla",
        "float32",
        "xla",
    )


def test_dense_splash_under_fsdp_and_tensor(make_cfg, compiled_once):
    """Read from test_muon's program: the optimizer changes neither the layers' kernels nor
    FSDP's gathers of their weights."""
    trainer, hlo, found = _compile_once(compiled_once, make_cfg, *FSDP_TENSOR_MUON)
    _has(found, ATTENTION)
    moved = _collectives(trainer, hlo)
    assert moved.get("ici all-gather fsdp", 0) > 0  # FSDP gathers the layers' weights
    assert not [k for k in moved if k.startswith("dcn")]


def test_configured_kernel_missing_is_an_error(make_cfg):
    """A program without the kernel a config names is refused, not passed off as that kernel."""
    trainer, hlo, found = _compile(make_cfg, "mesh.fsdp=4", "compute.attention=xla")
    assert found == {}
    splash = trainer.cfg.compute.model_copy(update={"attention": "splash"})
    with pytest.raises(program.MissingKernel, match="compute.attention=splash"):
        program.check_kernels(trainer.cfg.model, splash, found)


# gate-up's forward at 64 rows a tile, its input gradient at 32 (tokamax's choice is 128 here)
TILES = "compute.grouped_matmul_tiles={gate_up: {forward: {tile_m: 64}, input_grad: {tile_m: 32}}}"


def _moe_exchange(compiled_once: dict, make_cfg, dispatch: str, overflow: str) -> tuple:
    """tiny-moe's tokens split over fsdp 2 x expert 2, the weights shared over fsdp, under the
    exchange `dispatch`; the ragged one with TILES too, read by
    test_grouped_matmul_tiles_reach_each_pass_of_each_projection (tiles change no exchange)."""
    overrides = (
        *MOE,
        "mesh.fsdp=2",
        "mesh.expert=2",
        f"compute.expert_exchange={dispatch}",
        f"compute.expert_exchange_overflow={overflow}",
        *([TILES] if dispatch == "ragged" else []),
    )
    # remat full: the default's recompute sorts no assignment again
    return _compile_once(compiled_once, make_cfg, *overrides, remat="full")


@pytest.mark.parametrize(
    "dispatch, overflow, collective",
    [
        ("ragged", "rounds", "ragged-all-to-all"),
        ("all_to_all", "rounds", "all-to-all"),
        ("all_gather", "drop", "all-gather"),
    ],
)
def test_moe_exchanges(make_cfg, compiled_once, dispatch, overflow, collective):
    trainer, hlo, found = _moe_exchange(compiled_once, make_cfg, dispatch, overflow)
    _has(found, ATTENTION + GROUPED_MATMUL)
    moved = _collectives(trainer, hlo)
    assert moved.get(f"ici {collective} expert", 0) > 0, moved
    _moves_rows_by_gathers_and_sorts_once(trainer, hlo)
    if overflow == "rounds":  # the further rounds run in a loop only the routing bounds
        assert any("per loop trip" in key for key in moved), moved


def _moves_rows_by_gathers_and_sorts_once(trainer, hlo: str, layer_runs: int | None = None) -> None:
    """The TPU program moves the MoE's rows as the CPU one does (tests/layers/test_moe_permutation):
    no scatter of a device's tokens' rows (float, at least its tokens, emb wide) in any pass
    but the embedding's gradient (a scatter-add into the [vocab, emb] table), and one sort of
    the assignments (integers: the router's top-k sorts its float scores) per MoE layer a
    device runs (`layer_runs`, default the model's layers)."""
    model, train = trainer.cfg.model, trainer.cfg.train
    tokens = train.global_batch_size * train.seq_len // trainer.mesh.size
    row_scatters, assignment_sorts = [], 0
    for (op, shape), n in program.permutation_ops(hlo).items():
        dims = [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1])] if "[" in shape else []
        if op == "scatter" and shape.startswith(("f", "bf")) and dims[-1] == model.emb_dim:
            if math.prod(dims[:-1]) >= tokens and dims[:-1] != [model.vocab_size]:
                row_scatters.append(shape)
        if op == "sort" and not re.search(r"\bf\d+\[|bf16\[", shape):
            assignment_sorts += n
    assert not row_scatters, row_scatters
    assert assignment_sorts == (layer_runs or model.num_layers)


def _rows_per_tile(hlo: str, groups: int) -> dict[tuple[str, str, str], int]:
    """{(kernel, lhs, rhs): rows per tile} of tokamax's TPU grouped matmuls over `groups`
    experts, gmm (forward), gmm_transpose_rhs (input gradient) and tgmm (weight gradient): a
    kernel's group metadata (its third operand) lists the groups of its row tiles, tiles +
    groups - 1 of them."""
    found = {}
    for call in re.finditer(
        r"pallas_tpu_ragged_dot_(\w+?)[.\d]* = .*?operand_layout_constraints=\{(.*?)\}, [a-z_]+=",
        hlo,
    ):
        shapes = re.sub(r"\{[^}]*\}", "", call[2]).split(", ")
        tiles, rows = (int(re.search(r"\[(\d+)", shapes[i])[1]) for i in (2, -2))
        found[(call[1], shapes[-2], shapes[-1])] = rows // (tiles - groups + 1)
    return found


def test_grouped_matmul_tiles_reach_each_pass_of_each_projection(make_cfg, compiled_once):
    """compute.grouped_matmul_tiles picks tokamax's tiles per projection and pass (TILES):
    gate-up's forward at 64 rows a tile and its input gradient at 32, the rest on tokamax's
    choice (128 on v5e for these shapes), read from the kernels' group metadata in the
    compiled program of test_moe_exchanges' ragged case."""
    _, hlo, _ = _moe_exchange(compiled_once, make_cfg, "ragged", "rounds")
    # a round's buffer: compute.expert_exchange_capacity (1.25) x a device's 256 tokens x top-2
    rows = "bf16[640,128]"
    assert _rows_per_tile(hlo, groups=4) == {
        ("gmm", rows, "bf16[4,128,256]"): 64,  # gate-up forward
        ("gmm_transpose_rhs", "bf16[640,256]", "bf16[4,128,256]"): 32,  # its rows' gradient
        ("tgmm", rows, "bf16[640,256]"): 128,  # its weights' gradient
        ("gmm", rows, "bf16[4,128,128]"): 128,  # down forward
        ("gmm_transpose_rhs", rows, "bf16[4,128,128]"): 128,
        ("tgmm", rows, rows): 128,
    }


def test_grouped_matmul_tiles_of_another_platform_are_refused(make_cfg):
    """Tiles are checked against the kernel of the devices the program is built for."""
    cfg = make_cfg(*MOE, "compute.grouped_matmul_tiles={down: {forward: {block_m: 64}}}")
    with pytest.raises(config_lib.ConfigError, match=r"grouped_matmul_tiles\.down\.forward: "
                       r"\['block_m'\] are not fields of tokamax's tpu kernel"):  # fmt: skip
        run_model.for_platform(cfg, "tpu")


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
def test_context_parallel(make_cfg, exchange):
    trainer, hlo, _ = _compile(
        make_cfg, "mesh.fsdp=1", "mesh.context=4", f"compute.context_exchange={exchange}"
    )
    moved = _collectives(trainer, hlo)
    kind = "collective-permute" if exchange == "ring" else "all-gather"
    assert moved.get(f"ici {kind} context", 0) > 0, moved


def test_pipeline_stages(make_cfg):
    """Two stages of an MoE whose experts are split over the stage's two chips: the TPU default
    exchange (ragged) in its dropless rounds inside the stage map, its rows moved without
    scatters as outside it."""
    trainer, hlo, found = _compile(
        make_cfg,
        *MOE,
        "mesh.stage=2",
        "mesh.expert=2",
        "mesh.fsdp=1",
        "model.num_layers=4",
        "pipeline.microbatches=2",
        remat="full",  # the default's recompute sorts no assignment again
    )
    _has(found, ATTENTION + GROUPED_MATMUL)
    moved = _collectives(trainer, hlo)
    assert moved.get("ici collective-permute stage", 0) > 0, moved
    assert moved.get("ici ragged-all-to-all expert", 0) > 0, moved
    assert any("per loop trip" in key for key in moved), moved  # the further rounds' loop
    # Each device runs its stage's 2 layers in each of the M + S - 1 = 3 iterations.
    _moves_rows_by_gathers_and_sorts_once(trainer, hlo, layer_runs=6)


# test_pipeline_stages runs gpipe (with MoE stages); the other schedules on the smallest dense
# model that has their stages: two blocks per stage (circular, interleaved) need S x R = 4
# layers, the others one layer per stage.
SCHEDULES = {
    "circular": ("model.num_layers=4", "pipeline.repeats=2"),
    "1f1b": ("model.num_layers=2",),
    "interleaved_1f1b": ("model.num_layers=4", "pipeline.repeats=2"),
    "zero_bubble": ("model.num_layers=2",),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_schedules(make_cfg, schedule):
    """Stage 2 x fsdp 2: each schedule compiles to one program whose activations (and, in the
    tables that run the backward themselves, gradients) move between the stages by collective
    permutes, with splash's forward and backward kernels in it."""
    trainer, hlo, found = _compile(
        make_cfg,
        *SCHEDULES[schedule],
        f"pipeline.schedule={schedule}",
        "mesh.stage=2",
        "mesh.fsdp=2",
        "pipeline.microbatches=2",
    )
    _has(found, ATTENTION)
    moved = _collectives(trainer, hlo)
    assert moved.get("ici collective-permute stage", 0) > 0, moved


def test_mla_with_multi_token_prediction(make_cfg):
    _, _, found = _compile(
        make_cfg, "model_name=tiny-mla", "mesh.fsdp=4", "model.mtp.depth=1", "model.moe=null",
        "model.layers=null",
    )  # fmt: skip
    _has(found, ATTENTION)
    # The MTP block attends outside the layer scan: a backward kernel of its own beside the
    # layers' (one without multi-token prediction).
    assert found["splash_mha_dq_segmented_no_residuals"] == 2, found


def test_int8_training(make_cfg):
    _, hlo, found = _compile(make_cfg, *MOE, "mesh.fsdp=4", "quantization.preset=int8")
    _has(found, ATTENTION)
    assert "s8[" in hlo  # int8 operands reach the TPU's matmuls


def test_lora_on_an_nf4_base(make_cfg, tmp_path):
    trainer, hlo, found = _compile(
        make_cfg,
        "mesh.fsdp=4",
        "lora.rank=4",
        "lora.base_quantization=nf4",
        f"checkpoint.load_parameters_path={tmp_path / 'base'}",
    )
    _has(found, ATTENTION)
    frozen = {str(leaf.dtype) for leaf in jax.tree.leaves(trainer.state.frozen)}
    assert "uint4" in frozen and "u4[" in hlo  # the base's kernels reach the chip as 4-bit codes


def test_muon(make_cfg, compiled_once):
    trainer, hlo, found = _compile_once(compiled_once, make_cfg, *FSDP_TENSOR_MUON)
    _has(found, ATTENTION)
    # Newton-Schulz's matrices are dealt over the 4 chips that share them (optim/muon_deal.py):
    # a chip's block of every layer matrix goes out in one all-to-all and comes back in one (2
    # layers over 4 chips: padded to 4 matrices, a whole matrix each way); none is gathered.
    kernels = [x for x in jax.tree.leaves(trainer.state.params["layers"]) if x.ndim >= 3]
    one_matrix_each = sum(x.size // x.shape[0] * x.dtype.itemsize for x in kernels)
    moved = _collectives(trainer, hlo)
    assert moved.get("ici all-to-all fsdp+tensor", 0) == 2 * one_matrix_each, moved


def test_muon_scratch_is_the_memory_estimate():
    """Four layers' 4096 x 14336 MLP kernels (llama3-8b's) over 4 v5e chips: each chip
    orthogonalises one, and the TPU compiler's temporaries for the update are two of them,
    as analysis/memory.py's muon_scratch counts (within 10%)."""
    from maxtrain import optim
    from maxtrain.analysis.memory import muon_scratch
    from maxtrain.config import OptimConfig

    shape = (4, 4096, 14336)
    mesh = jax.sharding.Mesh(list(topology_devices(TOPOLOGY)), ("fsdp",))
    sharding = NamedSharding(mesh, P(None, "fsdp", None))
    params = {"layers": {"mlp": {"up": {"kernel": jax.ShapeDtypeStruct(shape, jnp.float32)}}}}
    shardings = {"layers": {"mlp": {"up": {"kernel": sharding}}}}
    tx, _ = optim.build(OptimConfig(name="muon"), 10, shardings)
    state = jax.eval_shape(tx.init, params)
    update = jax.jit(tx.update, in_shardings=(shardings, None, shardings))
    temp = update.lower(params, state, params).compile().memory_analysis().temp_size_in_bytes
    estimate = muon_scratch(shape, sharding.shard_shape(shape), (1, 1), 4)
    assert estimate == 2 * 4096 * 14336 * 4
    assert abs(temp - estimate) <= 0.1 * estimate, (temp, estimate)


def test_two_slices(make_cfg):
    """Two v5e:2x2 slices joined over DCN: data parallel across them, FSDP within."""
    trainer, hlo, found = _compile(
        make_cfg, "mesh.num_slices=2", "mesh.dcn.data=2", "mesh.fsdp=4", slices=2
    )
    _has(found, ATTENTION)
    moved = _collectives(trainer, hlo)
    assert moved.get("dcn all-reduce data", 0) > 0, moved  # gradients summed across slices
    assert not [k for k in moved if k.startswith("dcn") and "fsdp" in k], moved


def test_a_mesh_axis_may_split_a_physical_axis():
    """expert 8 on a 4x4 slice is no product of its physical axes (4, 4): the mesh splits one
    (kanana-moe's fsdp 32 x expert 8 on v5e:16x16 failed to build before)."""
    from maxtrain.config import MeshConfig
    from maxtrain.parallel.mesh import build_mesh

    mesh = build_mesh(MeshConfig(fsdp=2, expert=8), list(topology_devices("v5e:4x4")))
    assert (mesh.shape["fsdp"], mesh.shape["expert"]) == (2, 8)
    assert len({d.id for d in mesh.devices.flat}) == 16


def test_ragged_exchange_where_the_tpu_compiler_has_it(make_cfg):
    """The TPU compiler has no ragged all-to-all on a v5e slice beyond 16 chips (its limited
    ICI routing; compiled for v5e:8x8 it stops): "auto" takes all_to_all there, and an explicit
    ragged is refused in one line before anything compiles."""
    from maxtrain.config import ConfigError

    def exchange(topology):
        devices = topology_devices(topology)
        cfg = run_model.for_platform(make_cfg(*MOE), "tpu", devices[0].device_kind, len(devices))
        return cfg.compute.expert_exchange

    assert exchange("v5e:4x4") == "ragged"
    assert exchange("v5e:8x8") == "all_to_all"
    assert exchange("v6e:8x8") == "ragged"
    cfg = make_cfg(
        *MOE,
        "mesh.fsdp=-1",
        "mesh.expert=4",
        "compute.expert_exchange=ragged",
        "train.global_batch_size=64",
    )
    with pytest.raises(ConfigError, match="ragged does not compile on a 64-chip v5e slice"):
        build_trainer(cfg, devices=list(topology_devices("v5e:8x8")), abstract=True)


_DEFINED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ([a-z0-9]+\[[\d,]*\])")
_SPLASH_CALL = re.compile(
    r"^\s*(?:ROOT )?%(splash_mha_\w+?)(?:\.\d+)? = .*? custom-call\(%([\w.\-]+)"
)


def _splash_grids(hlo: str) -> dict[str, list[tuple[int, int]]]:
    """Per splash kernel, each call's grid per head, read from its block table (the call's
    first operand, data_next: [heads, query blocks, key blocks visited per query block]; the
    dkv kernel's [heads, query blocks visited per key block, key blocks])."""
    shapes = {m.group(1): m.group(2) for m in map(_DEFINED.match, hlo.splitlines()) if m}
    grids: dict[str, list[tuple[int, int]]] = {}
    for match in filter(None, map(_SPLASH_CALL.match, hlo.splitlines())):
        dims = shapes[match.group(2)].split("[")[1].rstrip("]").split(",")
        grids.setdefault(match.group(1), []).append(tuple(int(d) for d in dims[1:]))
    return grids


def test_windowed_splash_does_sequence_times_window_work():
    """Splash's work is its grid: block steps of 512 queries x 512 keys. XLA's cost analysis
    cannot see inside a Mosaic call (it reports the same FLOPs for a window as for causal
    attention) and a flash kernel's temporaries are O(T) either way, so the grid is read from
    the kernels' block tables, operands of their calls in the compiled TPU program. Forward
    and backward with sinks, per device (shard_map) on fsdp 2 x tensor 2 of v5e:2x2: from
    1024 to 2048 tokens (2 and 4 blocks) the grids of a 512-key window double, causal
    attention's quadruple."""
    devices = list(topology_devices(TOPOLOGY))
    mesh = build_mesh(MeshConfig(fsdp=2, tensor=2), devices)
    rules = config_lib.load(config_lib.CONFIGS_DIR / "base.yml").mesh.rules

    def grid_steps(window: int | None, length: int) -> dict[str, int]:
        kernel = attention_kernel("splash", window)

        def loss(q, k, v, segments, sinks):
            with sharding_rules(mesh, rules):
                return jnp.sum(kernel(q, k, v, segments, sinks).astype(jnp.float32))

        spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
            shape, dtype, sharding=NamedSharding(mesh, P())
        )
        args = (spec(2, length, 4, 128), spec(2, length, 2, 128), spec(2, length, 2, 128))
        extra = (spec(2, length, dtype=jnp.int32), spec(4, dtype=jnp.float32))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4)))
        grids = _splash_grids(grad.lower(*args, *extra).compile().as_text())
        assert set(grids) == {f"splash_mha_{k}_segmented_{r}" for k, r in
                              [("fwd", "residuals"), ("dq", "no_residuals"),
                               ("dkv", "no_residuals")]}, grids  # fmt: skip
        return {name: sum(q * k for q, k in calls) for name, calls in grids.items()}

    windowed = {t: grid_steps(512, t) for t in (1024, 2048)}
    causal = {t: grid_steps(None, t) for t in (1024, 2048)}
    for name, steps in windowed[1024].items():
        assert windowed[2048][name] == 2 * steps, (name, windowed)
        assert causal[2048][name] == 4 * causal[1024][name], (name, causal)
    # 4 query blocks of 2048 tokens: a window reaches its own and the previous key block
    assert windowed[2048]["splash_mha_fwd_segmented_residuals"] == 4 * 2
    assert causal[2048]["splash_mha_fwd_segmented_residuals"] == 4 * 4


def test_every_layer_kind_compiles_local_layers_to_windowed_splash(make_cfg):
    """A model of [local, global, linear, linear] layers, a window of 256 over 1536 tokens (3
    blocks of 512: the fewest where a window reaches fewer blocks than causal attention), one
    sequence per fsdp shard, GPT-OSS's attention sinks and Qwen3-Next's output gate, compiled
    on fsdp 2 x tensor 2 (sinks, gates and the DeltaNet's heads split with the heads): the
    attention run's switch holds both kinds' kernels, the global layers' stepping over every
    key block (3 x 3) and the local layers' over the two a window reaches (3 x 2), in the
    forward and both backward kernels; the linear layers scan their 24 chunks of 64 tokens."""
    _, hlo, found = _compile(
        make_cfg,
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "train.seq_len=1536",
        "model.max_seq_len=1536",
        "train.global_batch_size=2",
        "model.num_layers=4",
        "model.layers=[sliding-dense, global-dense, linear-dense*2]",
        "model.sliding_window=256",
        "model.attention_sinks=true",
        "model.attention_output_gate=true",
        "model.linear_attention={num_key_heads: 2, num_value_heads: 4, key_head_dim: 128, "
        "value_head_dim: 128}",
    )
    _has(found, ATTENTION)
    trips = program.loop_trip_counts(hlo)
    assert 24 in trips, trips  # the linear layers' scan over 1536 / 64 chunks
    grids = _splash_grids(hlo)
    assert set(grids["splash_mha_fwd_segmented_residuals"]) == {(3, 3), (3, 2)}, grids
    assert set(grids["splash_mha_dq_segmented_no_residuals"]) == {(3, 3), (3, 2)}, grids
    assert set(grids["splash_mha_dkv_segmented_no_residuals"]) == {(3, 3), (2, 3)}, grids


def test_deepseek_sparse_attention_under_fsdp_and_tensor(make_cfg):
    """One MLA layer with a lightning indexer (top 64 of the 128 tokens), its index heads
    split over tensor: the gathered attention compiles for the TPU, and no dense attention
    kernel runs beside it."""
    _, _, found = _compile(
        make_cfg, "model_name=tiny-mla", "mesh.fsdp=2", "mesh.tensor=2", "model.moe=null",
        "model.layers=null", "model.num_layers=1",
        "model.mla.indexer={heads: 4, head_dim: 32, top_k: 64}",
    )  # fmt: skip
    assert not any(name.startswith("splash") for name in found), found


def test_kimi_delta_attention_under_fsdp_and_tensor(make_cfg):
    """Kimi Delta Attention (model.linear_attention.channel_decay) on fsdp 2 x tensor 2, one
    layer of 4 heads of 128 over 128 tokens: the chunked rule scans its 2 chunks of 64 tokens,
    and the per-channel decay's parameters (the time-step bias [heads, dk], the rank-dk
    projection to [heads, dk]) split their heads over tensor, as the value heads do."""
    trainer, hlo, _ = _compile(
        make_cfg,
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "model.emb_dim=128",
        "model.layers=[linear-dense]",
        "model.linear_attention={num_key_heads: 4, num_value_heads: 4, key_head_dim: 128, "
        "value_head_dim: 128, channel_decay: true}",
        "compute.attention=xla",  # no attention layer to run splash
    )
    assert 2 in program.loop_trip_counts(hlo)  # 128 / 64 chunks
    linear = trainer.shardings.params["linear_layers"]["linear_attn"]  # [layers, ...]
    decay_bias, decay_up = linear["dt_bias"].spec, linear["a"]["kernel"].spec
    assert decay_bias[1] == "tensor", decay_bias  # [L, heads, dk]
    assert decay_up[2] == "tensor", decay_up  # [L, rank, heads, dk]
