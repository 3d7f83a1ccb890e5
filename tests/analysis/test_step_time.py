"""The step-time model (maxtrain/analysis/step_time.py) on small programs written by hand, against
times worked out by hand: a matmul at its dtype's peak or its bytes at HBM bandwidth, a loop by
its trip count, a collective over its group's links, hidden behind the compute between its start
and its done or waited for whole; a kernel's FLOPs from its operands; the TPU compiler's batched
matmul written as a padded convolution. And what the benchmark prints of it."""

import jax
import pytest

from maxtrain import config as config_lib
from maxtrain.analysis import collectives, hlo_costs, step_time
from maxtrain.benchmarks import step as benchmark
from maxtrain.common.devices import Chip, chip

# Round figures, so that every expected time below is a line of arithmetic.
CHIP = Chip(
    name="test chip",
    kinds=("test",),
    platform="tpu",
    peak_flops={"bf16": 1e12, "f32": 0.25e12, "int8": 2e12, "fp8": 2e12},
    hbm_gib=16,
    hbm_bytes_per_s=1e10,
    link_bytes_per_s=1e9,  # per port and direction: a torus dimension's ring sends 2e9 B/s
    ports=4,
    torus_dims=2,
    dcn_bytes_per_s=1e8,
    host_bytes_per_s=1e8,
)
HEADER = "HloModule test, is_scheduled=true, num_partitions=4\n\n"


def _predict(body: str, **placement) -> step_time.StepTimePrediction:
    return step_time.predict(HEADER + body, CHIP, step_time.Placement(**placement))


MATMUL = """ENTRY %main (a: DT[1024,512], b: DT[512,2048]) -> DT[1024,2048] {
  %a = DT[1024,512]{1,0} parameter(0)
  %b = DT[512,2048]{1,0} parameter(1)
  ROOT %dot = DT[1024,2048]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_a_matmul_takes_the_longer_of_its_flops_at_peak_and_its_bytes(dtype):
    """2 x 1024 x 512 x 2048 FLOPs at the dtype's peak, against its operands and result at
    HBM bandwidth: compute-bound in bfloat16 (2.15 ms > 0.73 ms), in float32 too (8.6 ms at a
    quarter of the peak > 1.47 ms of twice the bytes)."""
    size = {"bf16": 2, "f32": 4}[dtype]
    flops = 2 * 1024 * 512 * 2048
    hbm = (1024 * 512 + 512 * 2048 + 1024 * 2048) * size
    got = _predict(MATMUL.replace("DT", dtype))
    assert got.seconds == pytest.approx(max(flops / CHIP.peak(dtype), hbm / 1e10))
    assert (got.bound, got.flops, got.hbm_bytes) == ("matmul", flops, hbm)
    assert [c.instruction for c in got.top] == ["dot"]


ASYNC_SLICE = """ENTRY %main (t: f32[4096,128]) -> f32[1024,128] {
  %t = f32[4096,128]{1,0:T(8,128)} parameter(0)
  %s = ((f32[4096,128]{1,0:T(8,128)}), f32[1024,128]{1,0:T(8,128)SPACE}, s32[]{:S(2)}) slice-start(%t), slice={[1024:2048], [0:128]}
  ROOT %d = f32[1024,128]{1,0:T(8,128)SPACE} slice-done(%s)
}
"""  # noqa: E501


@pytest.mark.parametrize("space, hbm", [("S(1)", 1024 * 128 * 4), ("", 2 * 1024 * 128 * 4)])
def test_an_async_slice_moves_its_slice_not_its_operand(space, hbm):
    """The TPU compiler's slice-start (e.g. a quarter of an embedding shard into VMEM) passes
    its operand through in its result tuple: it reads the slice from HBM and writes it to VMEM
    (free) or HBM. Counting the operand read whole and written back, as once, gave a
    compiled MoE step 15 ms of HBM traffic that no chip would move."""
    got = _predict(ASYNC_SLICE.replace("SPACE", space))
    assert got.hbm_bytes == hbm


LOOP = """%body (p: (s32[], f32[256,256])) -> (s32[], f32[256,256]) {
  %p = (s32[], f32[256,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[256,256]{1,0} get-tuple-element(%p), index=1
  %y = f32[256,256]{1,0} multiply(%x, %x)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[256,256]{1,0}) tuple(%j, %y)
}

%cond (q: (s32[], f32[256,256])) -> pred[] {
  %q = (s32[], f32[256,256]{1,0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (x: f32[256,256]) -> (s32[], f32[256,256]) {
  %x = f32[256,256]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256,256]{1,0}) tuple(%zero, %x)
  ROOT %w = (s32[], f32[256,256]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_loop_counts_its_body_once_per_trip():
    """A body of an element-wise product (two reads and a write of 256 KiB) and a counter's
    add (three 4-byte scalars), run 5 times, the count read from the loop's condition."""
    once = (3 * 256 * 256 * 4 + 3 * 4) / 1e10
    got = _predict(LOOP.replace("TRIPS", "5"))
    assert got.seconds == pytest.approx(5 * once)
    assert got.bound == "memory"
    assert _predict(LOOP.replace("TRIPS", "10")).seconds == pytest.approx(10 * once)


GATHER = """ENTRY %main (x: bf16[256,1024], a: bf16[ROWS,2048], w: bf16[2048,COLS]) -> bf16[1024,1024] {
  %x = bf16[256,1024]{1,0} parameter(0)
  %a = bf16[ROWS,2048]{1,0} parameter(1)
  %w = bf16[2048,COLS]{1,0} parameter(2)
  START
  %d = bf16[ROWS,COLS]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  DONE
  ROOT %t = (bf16[ROWS,COLS]{1,0}, bf16[1024,1024]{1,0}) tuple(%d, %g)
}
"""  # noqa: E501
ASYNC = (
    "%s = (bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%x), channel_id=1, "
    "replica_groups={{0,1,2,3}}, dimensions={0}",
    "%g = bf16[1024,1024]{1,0} all-gather-done(%s)",
)
SYNC = (
    "%g = bf16[1024,1024]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3}}, "
    "dimensions={0}",
    "",
)


def _gather(rows: int, columns: int, async_: bool, **placement) -> step_time.StepTimePrediction:
    start, done = ASYNC if async_ else SYNC
    text = GATHER.replace("START", start).replace("DONE", done)
    return _predict(text.replace("ROWS", str(rows)).replace("COLS", str(columns)), **placement)


@pytest.mark.parametrize(("rows", "columns"), [(2048, 2048), (64, 128)], ids=["hidden", "exposed"])
def test_an_async_collective_overlaps_the_compute_before_its_done(rows, columns):
    """An all-gather of a 2 MiB result over 4 devices puts 3/4 of it on one torus dimension's
    ring (2 x 1e9 B/s): 0.79 ms. Started before a matmul and waited for after it, it costs
    only what the matmul does not cover: nothing beside a 17 ms matmul, 0.79 ms less the
    matmul beside a 0.08 ms one. Synchronous, it adds its whole time."""
    gather = 0.75 * 1024 * 1024 * 2 / 2e9
    flops = 2 * rows * 2048 * columns
    hbm = (rows * 2048 + 2048 * columns + rows * columns) * 2
    matmul = max(flops / 1e12, hbm / 1e10)
    hidden = _gather(rows, columns, async_=True)
    assert hidden.seconds == pytest.approx(max(matmul, gather))
    exposed = hidden.breakdown.get("collectives group of 4", 0.0)
    assert exposed == pytest.approx(max(0.0, gather - matmul))
    assert _gather(rows, columns, async_=False).seconds == pytest.approx(matmul + gather)


def test_a_group_spanning_two_torus_dimensions_has_both_rings():
    """The same all-gather over a 2x2 slice's four chips (a group spanning both dimensions)
    runs on both dimensions' rings: half the time."""
    one = _gather(64, 128, async_=False)
    both = _gather(64, 128, async_=False, slice_shape=(2, 2))
    gather = 0.75 * 1024 * 1024 * 2 / 2e9
    assert one.seconds - both.seconds == pytest.approx(gather / 2)


SPLASH = """ENTRY %main (t: s32[1,4,4], q: bf16[8,2048,128], k: bf16[8,2048,128], v: bf16[8,2048,128]) -> bf16[8,2048,128] {
  %t = s32[1,4,4]{2,1,0} parameter(0)
  %q = bf16[8,2048,128]{2,1,0} parameter(1)
  %k = bf16[8,2048,128]{2,1,0} parameter(2)
  %v = bf16[8,2048,128]{2,1,0} parameter(3)
  ROOT %splash_mha_KIND.3 = RESULT custom-call(%t, %q, %k, %v), custom_call_target="tpu_custom_call"
}
"""  # noqa: E501
QKV = "bf16[8,2048,128]{2,1,0}"


@pytest.mark.parametrize(
    ("kind", "result", "matmuls"),
    [
        ("fwd_segmented_residuals", f"({QKV}, f32[8,2048]{{1,0}})", 2),
        ("dq_segmented_no_residuals", QKV, 3),
        ("dkv_segmented_no_residuals", f"({QKV}, {QKV})", 4),
        ("dkv_segmented_no_residuals", f"({QKV}, {QKV}, {QKV})", 5),  # the fused backward
    ],
)
def test_attention_kernel_flops_from_its_operands(kind, result, matmuls):
    """Splash attention over 8 heads of 2048 queries and keys of 128: per matmul 2 x 8 x
    2048 x 2048 x 128 FLOPs, on the blocks its 4 x 4 block table keeps of a causal mask (10 of
    16); 2 matmuls forward, 3 for dQ, 4 for dK and dV, 5 for all three at once."""
    text = HEADER + SPLASH.replace("KIND", kind).replace("RESULT", result)
    module = hlo_costs.Module(text)
    flops, dtype = module.flops("splash_mha_KIND.3".replace("KIND", kind))
    assert (flops, dtype) == (matmuls * 2 * 8 * 2048 * 2048 * 128 * 10 / 16, "bf16")
    assert not module.unknown_kernels
    kernels = step_time.predict(text, CHIP).kernels
    assert list(kernels) == [f"splash_mha_{kind}"] and kernels[f"splash_mha_{kind}"] > 0


CONVOLUTION = """ENTRY %main (x: bf16[2,64,32,1], w: bf16[32,4,16,1]) -> bf16[2,64,4,16] {
  %x = bf16[2,64,32,1]{3,2,1,0} parameter(0)
  %w = bf16[32,4,16,1]{3,2,1,0} parameter(1)
  ROOT %c = bf16[2,64,4,16]{3,2,1,0} convolution(%x, %w), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}
"""  # noqa: E501


def test_a_batched_matmul_written_as_a_padded_convolution_counts_its_real_products():
    """The TPU compiler's form of x[2, 64, 32] @ w[32, 4 heads, 16]: the heads a spatial
    dimension whose window of 4, padded by 3 each side, meets the one input position per
    output: 2 x 2 x 64 x 4 x 32 x 16 FLOPs, not 4 times that."""
    flops, _ = hlo_costs.Module(HEADER + CONVOLUTION).flops("c")
    assert flops == 2 * 2 * 64 * 4 * 32 * 16


@pytest.fixture(scope="module")
def cpu_dry_run(tmp_path_factory):
    """tools/benchmark.py --dry-run --compile on this host's CPU devices, for a tiny model:
    (config, the benchmark's result, the compiled program's text)."""
    devices = jax.device_count()
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [
            "model_name=tiny",
            "data.kind=synthetic",
            "train.seq_len=32",
            f"train.global_batch_size={devices}",
        ],
    )
    path = tmp_path_factory.mktemp("step") / "step.hlo"
    kind = jax.devices()[0].device_kind
    result = benchmark.dry_run(cfg, devices, True, kind, hlo_path=str(path))
    return cfg, result, path.read_text()


@pytest.mark.slow  # runs the benchmark's dry run
def test_the_benchmark_says_why_a_cpu_has_no_prediction(cpu_dry_run):
    _, result, _ = cpu_dry_run
    predicted = result["compiled"]["predicted"]
    assert predicted["chip"] is None and "cpu" in predicted["why"].lower()


@pytest.mark.slow  # runs the benchmark's dry run
def test_the_benchmark_prints_the_step_its_throughput_mfu_and_bound(cpu_dry_run):
    """What the benchmark prints for a chip, from the same compiled CPU program timed on a
    v5e's figures: the step, tokens/s and model TFLOP/s per chip at that step and the MFU
    they are of the chip's peak, the categories adding up to the step, five instructions."""
    cfg, _, hlo = cpu_dry_run
    prediction = step_time.predict(hlo, chip("TPU v5 lite"))
    flops_per_token = 1e9
    got = step_time.summary(prediction, cfg.tokens_per_step, jax.device_count(), flops_per_token)
    assert got["chip"] == "TPU v5e" and got["bound"] in got["seconds_by_category"]
    assert sum(got["seconds_by_category"].values()) == pytest.approx(got["step_s"], rel=1e-3)
    tokens = cfg.tokens_per_step / prediction.seconds / jax.device_count()
    assert got["tokens_per_sec_per_chip"] == pytest.approx(tokens, rel=1e-3)
    assert got["mfu"] == pytest.approx(tokens * flops_per_token / 197e12, rel=1e-3)
    assert len(got["top_instructions"]) == 5 and prediction.flops > 0
    assert got["kernels_s"] == {}  # plain XLA attention on CPU: no hand-written kernel


FUSED = """%start (p: bf16[256,1024]) -> (bf16[256,1024], bf16[1024,1024], u32[]) {
  %p = bf16[256,1024]{1,0} parameter(0)
  %g1 = bf16[1024,1024]{1,0} all-gather(%p), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  %f = u32[] constant(0)
  ROOT %t1 = (bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}, u32[]) tuple(%p, %g1, %f)
}

%overlapped (q: bf16[256,1024], a: bf16[2048,2048], w: bf16[2048,2048]) -> (bf16[2048,2048], bf16[1024,1024]) {
  %q = bf16[256,1024]{1,0} parameter(0)
  %a = bf16[2048,2048]{1,0} parameter(1)
  %w = bf16[2048,2048]{1,0} parameter(2)
  %g2 = bf16[1024,1024]{1,0} all-gather(%q), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  %d = bf16[2048,2048]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t2 = (bf16[2048,2048]{1,0}, bf16[1024,1024]{1,0}) tuple(%d, %g2)
}

%done (r: bf16[256,1024]) -> bf16[1024,1024] {
  %r = bf16[256,1024]{1,0} parameter(0)
  %g3 = bf16[1024,1024]{1,0} all-gather(%r), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %c = bf16[1024,1024]{1,0} custom-call(%r, %g3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (x: bf16[256,1024], a: bf16[2048,2048], w: bf16[2048,2048]) -> bf16[2048,2048] {
  %x = bf16[256,1024]{1,0} parameter(0)
  %a = bf16[2048,2048]{1,0} parameter(1)
  %w = bf16[2048,2048]{1,0} parameter(2)
  %async-collective-start.1 = (bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}, u32[]) fusion(%x), kind=kCustom, calls=%start
  %fusion.2 = (bf16[2048,2048]{1,0}, bf16[1024,1024]{1,0}) fusion(%x, %a, %w), kind=kOutput, calls=%overlapped
  %async-collective-done.1 = bf16[1024,1024]{1,0} fusion(%x), kind=kCustom, calls=%done
  ROOT %out = (bf16[2048,2048]{1,0}, bf16[1024,1024]{1,0}) tuple(%fusion.2, %async-collective-done.1)
}
"""  # noqa: E501


def test_the_tpu_compilers_async_collective_counts_once_and_hides_behind_its_fusion():
    """The TPU compiler's asynchronous all-gather: a start fusion, a fusion of the compute it
    overlaps, a done fusion, each holding a copy of the collective under one channel. Its
    bytes count once (2 MiB, not 6), and its 0.79 ms hide behind the 17 ms matmul fused with
    it: the step is the fusion's time alone."""
    text = HEADER + FUSED
    assert collectives.collective_bytes(text) == {"all-gather": 1024 * 1024 * 2}
    matmul = 2 * 2048**3 / 1e12
    hbm = (256 * 1024 + 2 * 2048 * 2048 + 2048 * 2048 + 1024 * 1024) * 2 / 1e10
    got = step_time.predict(text, CHIP)
    assert got.seconds == pytest.approx(max(matmul, hbm))
    assert got.breakdown.get("collectives group of 4", 0.0) == 0.0
