"""LoRA and QLoRA (maxtrain/posttrain/lora.py): zero adapters leave the model as it was, only the
adapters train, their gradients are the chain rule through the merged weight, QLoRA runs on the
dequantized base, the experts' adapters work under expert parallelism, and a run resumes
bit-exactly from checkpoints that hold the adapters alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from maxtrain.config import ConfigError
from maxtrain.data import to_global
from maxtrain.data.synthetic import SyntheticText
from maxtrain.parallel.mesh import sharding_rules
from maxtrain.posttrain import lora
from maxtrain.training import run_model
from maxtrain.training.loop import build_trainer, run
from maxtrain.training.state import frozen_state
from maxtrain.training.step import summed_grads

LORA = ["lora.rank=4", "lora.alpha=8", "checkpoint.load_parameters_path=unused"]
SMALL = [
    "model_name=tiny",
    "data.kind=synthetic",
    "train.global_batch_size=8",
    "train.seq_len=32",
    "optim.warmup_steps=1",  # the rate is 0 at the first step, the peak after it
]


def _batch(trainer):
    cfg = trainer.cfg
    source = SyntheticText(cfg.model.vocab_size, cfg.train.seq_len, 4, seed=0, stream=0)
    return to_global(source.batch(0, range(cfg.train.global_batch_size)), trainer.batch_sharding)


def _with_base(trainer, base):
    """The trainer's state with `base` (a plain model's params) as its frozen base."""
    cfg = trainer.cfg
    frozen = frozen_state(cfg, trainer.mdef, trainer.shardings, base)
    trainer.state = trainer.state.replace(frozen=frozen)
    return trainer


def _perturbed(adapters):
    """The adapters plus noise: B nonzero, so that the gradients of both A and B are."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, noisy)


def _logits(trainer, params, batch):
    apply = lambda p, b: trainer.mdef.apply(p, b["inputs"], b["positions"], b["segment_ids"])[0]  # noqa: E731
    with sharding_rules(trainer.mesh, trainer.cfg.mesh.rules):
        return jax.jit(apply)(params, batch)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A plain tiny model and the same model with adapters on attention and MLP, on 8 devices
    (fsdp 4 x tensor 2), its frozen base the plain model's parameters."""
    from maxtrain import config as config_lib
    from tests.conftest import BASE

    tmp = tmp_path_factory.mktemp("lora")
    common = [*SMALL, f"run.output_dir={tmp}", "mesh.fsdp=4", "mesh.tensor=2"]
    plain = build_trainer(config_lib.load(BASE, common))
    adapted = build_trainer(config_lib.load(BASE, [*common, *LORA, "lora.modules=[attention,mlp]"]))
    return plain, _with_base(adapted, plain.state.params)


def test_zero_adapters_leave_the_logits_unchanged(dense):
    plain, adapted = dense
    batch = _batch(plain)
    assert jax.tree.leaves(adapted.state.params)  # there are adapters, B all zero
    for path, leaf in jax.tree.leaves_with_path(adapted.state.params):
        if jax.tree_util.keystr(path).endswith("'kernel_lora_b']"):
            assert not np.any(np.asarray(leaf))
    expected = _logits(plain, plain.state.params, batch)
    got = _logits(adapted, adapted.model_params(), batch)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_only_the_adapters_train(dense):
    """The optimizer holds only the adapters; three steps leave the base bit-equal and move
    every adapter (the first step's rate is 0; then B moves, and A from the step after, its
    gradient being zero while B is)."""
    _, adapted = dense
    adapted_names = {
        jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(adapted.state.params)
    }
    assert adapted_names and all(n.endswith(("_lora_a']", "_lora_b']")) for n in adapted_names)
    opt_leaves = [x for x in jax.tree.leaves(adapted.state.opt_state) if x.ndim > 0]
    adapter_size = sum(x.size for x in jax.tree.leaves(adapted.state.params))
    assert sum(x.size for x in opt_leaves) == 2 * adapter_size  # Adam's two moments, no more

    batch = _batch(adapted)
    base_before = jax.device_get(adapted.state.frozen)
    start = jax.device_get(adapted.state.params)
    state = adapted.state
    for _ in range(3):
        state, metrics = adapted.step_fn(state, batch)
        assert bool(metrics["finite"])
    adapted.state = state
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(state.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    for (path, a), b in zip(
        jax.tree.leaves_with_path(start), jax.tree.leaves(state.params), strict=True
    ):
        assert np.any(a != np.asarray(b)), jax.tree_util.keystr(path)


def test_adapter_gradients_are_the_chain_rule_through_the_merged_weight(dense):
    """dL/dB = s A^T dL/dW' and dL/dA = s dL/dW' B^T, with dL/dW' the plain model's gradient
    at the merged weights W' = W + s A B: an oracle that never runs Qwix."""
    plain, adapted = dense
    cfg, batch = adapted.cfg, _batch(adapted)
    params = _perturbed(adapted.state.params)
    frozen = adapted.state.frozen

    def grads(trainer, p, f=None):
        with sharding_rules(trainer.mesh, cfg.mesh.rules):
            return summed_grads(trainer.mdef, p, batch, 0.0, frozen=f, split=trainer.split)[0]

    got = jax.device_get(jax.jit(lambda p, f: grads(adapted, p, f))(params, frozen))
    merged = lora.merge(lora.combine(frozen, params), cfg.lora, adapted.mdef.abstract_state)
    dw = jax.device_get(jax.jit(lambda p: grads(plain, p))(merged))
    s = cfg.lora.scale
    for stack, block, name in [
        ("layers", "attn", "q"),
        ("layers", "attn", "o"),
        ("layers", "mlp", "down"),
    ]:
        a = np.asarray(params[stack][block][name][lora.A], np.float64)
        b = np.asarray(params[stack][block][name][lora.B], np.float64)
        g = np.asarray(dw[stack][block][name]["kernel"], np.float64)
        layers = g.shape[0]
        a2, b2 = a.reshape(layers, -1, a.shape[-1]), b.reshape(layers, b.shape[1], -1)
        g2 = g.reshape(layers, a2.shape[1], b2.shape[2])
        want_b = s * np.einsum("lir,lio->lro", a2, g2).reshape(b.shape)
        want_a = s * np.einsum("lio,lro->lir", g2, b2).reshape(a.shape)
        np.testing.assert_allclose(got[stack][block][name][lora.B], want_b, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(got[stack][block][name][lora.A], want_a, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_qlora_runs_on_the_dequantized_base(dense, make_cfg, qtype):
    """The frozen layer kernels are stored quantized; the model computes with them dequantized
    (the plain model on the dequantized base, with zero adapters); a step trains."""
    plain, _ = dense
    cfg = make_cfg(*LORA, f"lora.base_quantization={qtype}", "mesh.fsdp=4", "mesh.tensor=2")
    trainer = _with_base(build_trainer(cfg), plain.state.params)
    kernel = trainer.state.frozen["layers"]["attn"]["q"]["kernel"]
    assert isinstance(kernel, qwix.QArray) and kernel.qtype == qtype
    assert not isinstance(trainer.state.frozen["embedding"], qwix.QArray)  # only layer kernels
    batch = _batch(trainer)
    expected = _logits(plain, lora.dequantized(trainer.state.frozen), batch)
    got = _logits(trainer, trainer.model_params(), batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    loss_w = np.asarray(plain.state.params["layers"]["attn"]["q"]["kernel"])
    err = np.linalg.norm(np.asarray(qwix.dequantize(kernel)) - loss_w) / np.linalg.norm(loss_w)
    assert 0 < err < (0.01 if qtype == "int8" else 0.15)
    state, metrics = trainer.step_fn(trainer.state, batch)
    assert bool(metrics["finite"]) and float(metrics["grad_norm"]) > 0


def test_expert_adapters_under_expert_parallelism(make_cfg):
    """tiny-moe with adapters on the routed experts too, experts split over 4 devices: zero
    adapters give the base model's loss, and training moves the experts' B."""
    common = ["model_name=tiny-moe", "mesh.expert=4", "mesh.fsdp=2", "train.seq_len=32"]
    plain = build_trainer(make_cfg(*common))
    cfg = make_cfg(*common, *LORA, "lora.modules=[attention,experts]")
    trainer = _with_base(build_trainer(cfg), plain.state.params)
    expert_b = trainer.state.params["moe_layers"]["moe"]["down"][lora.B]
    assert expert_b.shape[-3:] == (cfg.model.moe.num_experts, 4, cfg.model.emb_dim)
    batch = _batch(trainer)
    _, plain_metrics = plain.step_fn(plain.state, batch)
    state, metrics = trainer.step_fn(trainer.state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(plain_metrics["loss"]), rtol=1e-6)
    state, _ = trainer.step_fn(state, batch)  # the first step's rate is 0
    moved = np.asarray(state.params["moe_layers"]["moe"]["down"][lora.B])
    assert np.any(moved != 0)


# The LoRA runs' one lr schedule: the flat runs of 1, 2 and 4 steps below compile one step
# program between them.
RUN_SCHEDULE = "optim.schedule_steps=4"


def test_lora_run_resumes_bit_exactly(dense, make_cfg, tmp_path):
    """A base checkpoint (the dense fixture's plain parameters), then a LoRA run of 4 steps
    against 2 steps and a resume to 4: the same adapters, bit for bit (the frozen base is
    re-read at the resume, never saved)."""
    from maxtrain.checkpointing.export import save_parameters

    base_ckpt = save_parameters(tmp_path / "base", dense[0].state.params)
    lora_args = [
        "lora.rank=4",
        f"checkpoint.load_parameters_path={base_ckpt}",
        "checkpoint.persistent.every_steps=2",
        RUN_SCHEDULE,
    ]
    straight = make_cfg(*lora_args, "run.name=straight", "train.steps=4")
    run(straight)
    run(make_cfg(*lora_args, "run.name=split", "train.steps=2"))
    split = make_cfg(*lora_args, "run.name=split", "train.steps=4")
    run(split)

    def adapters(cfg):
        from maxtrain.checkpointing import load_parameters

        trainer = build_trainer(cfg, abstract=True)
        step = cfg.run_dir / "checkpoints" / "persistent" / "4"
        return jax.device_get(load_parameters(step, trainer.saved.abstract(trainer.state).params))

    a, b = adapters(straight), adapters(split)
    assert jax.tree.leaves(a)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# ---- pipeline stages (parallel/pipeline.py) ------------------------------------------------------

STAGED = ["mesh.stage=2", "mesh.fsdp=4"]


@pytest.fixture(scope="module")
def staged(dense, tmp_path_factory):
    """The dense fixture's plain model and a QLoRA one (nf4 base) in two pipeline stages of 4
    devices (fsdp), its frozen base the plain model's parameters, read in model order as from
    a checkpoint."""
    from maxtrain import config as config_lib
    from tests.conftest import BASE

    base = dense[0].state.params
    common = [*SMALL, f"run.output_dir={tmp_path_factory.mktemp('staged')}", *STAGED]
    plain = build_trainer(config_lib.load(BASE, common))
    adapted = build_trainer(config_lib.load(BASE, [*common, *LORA, "lora.base_quantization=nf4"]))
    return plain, _with_base(adapted, base)


def _loss_and_grads(trainer, batch):
    """(params, frozen) -> the summed token loss and its gradients, one compile for all calls."""

    def fn(params, frozen):
        grads, sums = summed_grads(
            trainer.mdef, params, batch, 0.0, frozen=frozen, split=trainer.split
        )
        return sums.loss, grads

    compiled = jax.jit(fn)

    def call(params, frozen):
        with sharding_rules(trainer.mesh, trainer.cfg.mesh.rules):
            loss, grads = jax.device_get(compiled(params, frozen))
        return float(loss), grads

    return call


def test_qlora_in_stages_computes_what_it_does_without(dense, staged):
    """In two stages: the base's layer kernels are quantized as without stages (a scale per
    layer, never shared across stages), zero adapters give the plain pipelined model's loss on
    the dequantized base, and nonzero ones the gradients of the same adapters without stages
    on that base (moved into model order)."""
    from maxtrain.parallel import pipeline

    base, flat = dense[0].state.params, dense[1]
    plain, adapted = staged
    layout, lcfg = adapted.mdef.layout, adapted.cfg.lora
    assert jax.tree.leaves(adapted.state.params[pipeline.STAGES])  # the adapters are in stages
    kernel = adapted.state.frozen[pipeline.STAGES]["layers"]["attn"]["q"]["kernel"]
    assert isinstance(kernel, qwix.QArray) and kernel.qtype == "nf4"
    dequantized = lora.dequantized(adapted.state.frozen)  # in stages
    in_model_order = pipeline.to_model_order(jax.device_get(dequantized), layout)
    quantize = lambda b: lora.quantized_kernels(b, flat.mdef.abstract_state, lcfg)  # noqa: E731
    want = jax.device_get(lora.dequantized(jax.jit(quantize)(base)))
    for x, y in zip(jax.tree.leaves(in_model_order), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)

    batch = _batch(adapted)
    in_stages = _loss_and_grads(adapted, batch)
    plain_loss = float(plain.eval_fn(dequantized, None, batch)["nll_sum"])
    np.testing.assert_allclose(
        in_stages(adapted.state.params, adapted.state.frozen)[0], plain_loss, rtol=1e-6
    )

    params = _perturbed(flat.state.params)
    flat_base = frozen_state(flat.cfg, flat.mdef, flat.shardings, in_model_order)
    want = _loss_and_grads(flat, batch)(params, flat_base)[1]
    staged_grads = in_stages(pipeline.to_stages(params, layout), adapted.state.frozen)[1]
    got = pipeline.to_model_order(staged_grads, layout)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, w), g in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), strict=True):
        scale = np.max(np.abs(w))
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("stacks", [("layers", "moe_layers"), ("moe_layers",), ("layers",)])
def test_adapter_trees_move_into_stages_and_back(make_cfg, stacks):
    """An adapter tree (no embedding, maybe one kind of layer only: experts, or the dense first
    layer's MLP) and its optimizer moments: map_params moves each stack's layers after the
    first dense one into the stages, and back, as the layers of full parameters."""
    import optax

    from maxtrain.parallel import pipeline

    cfg = make_cfg(
        "model_name=tiny-moe",
        "model.num_layers=5",
        "model.layers=[global-dense, global-moe*4]",
        "model.mlp_dim=128",
        *STAGED,
    )
    layout = run_model.stage_layout(cfg)  # 1 dense layer, then 2 stages of 2 MoE layers
    counts = {"layers": 1, "moe_layers": 4}
    adapters = {k: {"a": np.arange(counts[k] * 3.0).reshape(counts[k], 3)} for k in stacks}
    state = (adapters, optax.adam(1.0).init(adapters))
    moved = pipeline.map_params(state, lambda p: pipeline.to_stages(p, layout))
    if "moe_layers" in stacks:
        stage_a = moved[0][pipeline.STAGES]["moe_layers"]["a"]
        np.testing.assert_array_equal(stage_a[0, 1], adapters["moe_layers"]["a"][2:])
        assert moved[1][0].mu[pipeline.STAGES]["moe_layers"]["a"].shape == (1, 2, 2, 3)
    else:
        assert pipeline.STAGES not in moved[0]  # the dense first layer stays before the stages
    back = pipeline.map_params(moved, lambda p: pipeline.to_model_order(p, layout))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(x, y)


def test_staged_lora_checkpoints_hold_the_adapters_in_model_order(dense, make_cfg, tmp_path):
    """The dense fixture's base, then LoRA runs of 2 steps: in two stages straight, and
    without stages for a step then resumed in stages. Both checkpoints read as a run without
    stages reads them, and hold the same adapters: saving moved them (and their optimizer
    moments) out of the stages, restoring into them."""
    from maxtrain.checkpointing import load_parameters
    from maxtrain.checkpointing.export import save_parameters

    base = save_parameters(tmp_path / "base", dense[0].state.params)
    lora_args = [
        "lora.rank=4",
        f"checkpoint.load_parameters_path={base}",
        "checkpoint.persistent.every_steps=1",
        "train.steps=2",
        RUN_SCHEDULE,
    ]
    straight = make_cfg(*lora_args, *STAGED, "run.name=straight")
    run(straight)
    run(make_cfg(*lora_args, "run.name=resumed", "train.steps=1"))
    resumed = make_cfg(*lora_args, *STAGED, "run.name=resumed")
    run(resumed)

    flat = build_trainer(make_cfg(*lora_args, "run.name=flat"), abstract=True)
    abstract = flat.saved.abstract(flat.state).params
    for step in (1, 2):
        a, b = (
            jax.device_get(
                load_parameters(cfg.run_dir / "checkpoints" / "persistent" / str(step), abstract)
            )
            for cfg in (straight, resumed)
        )
        for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(
                x, y, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path)
            )
    moved = [
        np.any(x != 0) for p, x in jax.tree.leaves_with_path(a) if lora.B in jax.tree_util.keystr(p)
    ]
    assert moved and all(moved)  # step 2 trained every B (the first step's rate is 0)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["lora.rank=4"], "lora.rank=4 needs checkpoint.load_parameters_path"),
        ([*LORA, "quantization.preset=int8"], "for a quantized base use lora.base_quantization"),
        (["lora.modules=[mlp,mlp]"], "lora.modules lists a module twice"),
        ([*LORA, "lora.base_quantization=int3"], "lora.base_quantization"),
        ([*LORA, "lora.modules=[experts]"], "this model has no routed experts"),
    ],
)
def test_bad_lora_configs_are_refused_in_one_line(make_cfg, overrides, error):
    with pytest.raises(ConfigError, match=error):
        make_cfg(*overrides)


def test_modules_that_match_no_matmul_are_refused(make_cfg):
    """Every layer an MoE without shared experts: lora.modules=[mlp] adapts nothing."""
    cfg = make_cfg(
        "model_name=tiny-moe", "model.moe.shared_experts=0", *LORA, "lora.modules=[mlp]",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"lora.modules=\['mlp'\] matches no matmul"):
        build_trainer(cfg, abstract=True)


def test_minimal_remat_recomputes_low_rank_products():
    """remat=minimal keeps a projection's output but not a low-rank product's ((x A) B sums
    over the adapter rank): kept, LoRA's products doubled the activations (H100: 44.8 GiB for
    the dense-1.5b recipe at rank 16, 27.6 GiB recomputed)."""
    from maxtrain.models.decoder import REMAT_POLICIES

    policy = REMAT_POLICIES["minimal"]
    tokens = jax.core.ShapedArray((4096, 16), jnp.float32)  # x A: [tokens, rank]
    b = jax.core.ShapedArray((16, 8192), jnp.float32)
    x = jax.core.ShapedArray((4096, 2048), jnp.float32)
    w = jax.core.ShapedArray((2048, 8192), jnp.float32)
    numbers = {"dimension_numbers": (((1,), (0,)), ((), ()))}
    assert policy(jax.lax.dot_general_p, x, w, **numbers)
    assert not policy(jax.lax.dot_general_p, tokens, b, **numbers)


def test_adapters_compute_in_the_compute_dtype(make_cfg):
    """With bfloat16 compute a LoRA step has no more float32 matmuls than the plain model's step
    (its loss and statistics): the float32 adapters are cast like the kernels
    (models/definition.py), so the low-rank products multiply bfloat16 operands."""
    from maxtrain.analysis.program import matmul_dtypes

    def not_bf16(trainer):
        counts = matmul_dtypes(trainer.step_fn, trainer.state, _batch(trainer))
        return {key: n for key, n in counts.items() if key[1] != ("bfloat16", "bfloat16")}

    bf16 = ["compute.compute_dtype=bfloat16", "mesh.fsdp=8"]
    plain, adapted = build_trainer(make_cfg(*bf16)), build_trainer(make_cfg(*bf16, *LORA))
    assert not_bf16(adapted) == not_bf16(plain)
