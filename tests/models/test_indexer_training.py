"""DeepSeek sparse attention's two training stages from config, on a tiny MLA model with a
lightning indexer (top 8 of 32 keys): the dense warm-up trains the indexers alone (the rest
frozen, posttrain/indexer_warmup.py) and their KL falls; in the sparse stage the indexer's
input is detached, so the token loss never reaches the indexer and its KL reaches nothing
else (models/indexer_training.py, layers/mla.py)."""

import jax
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.config import ConfigError
from maxtrain.data import to_global
from maxtrain.data.synthetic import SyntheticText
from maxtrain.parallel.mesh import sharding_rules
from maxtrain.posttrain.indexer_warmup import split_indexers
from maxtrain.training.loop import build_trainer
from maxtrain.training.state import frozen_state
from tests.conftest import BASE

INDEXER = ("model_name=tiny-mla", "model.mla.indexer={heads: 4, head_dim: 16, top_k: 8}")
WARMUP = ("model.mla.indexer.stage=warmup", "checkpoint.load_parameters_path=unused")


def _batch(trainer):
    cfg = trainer.cfg
    source = SyntheticText(cfg.model.vocab_size, cfg.train.seq_len, 4, seed=0, stream=0)
    return to_global(source.batch(0, range(cfg.train.global_batch_size)), trainer.batch_sharding)


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    return [
        *INDEXER, "data.kind=synthetic", "train.global_batch_size=8", "train.seq_len=32",
        "optim.warmup_steps=1", f"run.output_dir={tmp_path_factory.mktemp('dsa')}",
        "init.std=0.2",  # attention far from uniform: a KL to learn
    ]  # fmt: skip


@pytest.fixture(scope="module")
def sparse(overrides):
    return build_trainer(config_lib.load(BASE, overrides))


def test_warmup_trains_only_the_indexers_and_their_kl_falls(sparse, overrides):
    cfg = config_lib.load(BASE, [*overrides, *WARMUP])
    warmup = build_trainer(cfg)
    indexers, rest = split_indexers(jax.device_get(sparse.state.params))
    frozen = frozen_state(cfg, warmup.mdef, warmup.shardings, rest)
    warmup.state = warmup.state.replace(frozen=frozen)
    trained = jax.device_get(warmup.state.params)
    assert jax.tree.structure(trained) == jax.tree.structure(indexers)  # the optimizer's all
    batch = _batch(warmup)
    state, kl = warmup.state, []
    for _ in range(8):
        state, metrics = warmup.step_fn(state, batch)
        kl.append(float(metrics["indexer/kl"]))
    for a, b in zip(jax.tree.leaves(rest), jax.tree.leaves(state.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    for (path, a), b in zip(
        jax.tree.leaves_with_path(trained), jax.tree.leaves(state.params), strict=True
    ):
        assert np.any(a != np.asarray(b)), jax.tree_util.keystr(path)
    print("warm-up KL per step:", [f"{x:.4f}" for x in kl])
    assert kl[-1] < 0.9 * kl[1], kl  # the first step's rate is 0


def test_sparse_stage_keeps_the_indexer_and_the_model_losses_apart(sparse):
    """Gradients of the token loss (here any function of the logits) reach every parameter
    but the indexers'; those of the indexers' KL reach theirs alone."""
    batch = _batch(sparse)
    mdef, params = sparse.mdef, sparse.state.params
    cot = jax.random.normal(
        jax.random.key(0), (*batch["inputs"].shape, sparse.cfg.model.vocab_size)
    )

    def losses(p):
        out = mdef.apply(p, batch["inputs"], batch["positions"], batch["segment_ids"])
        return (out.logits * cot).sum(), out.aux_loss

    both = lambda p: (jax.grad(lambda p: losses(p)[0])(p), jax.grad(lambda p: losses(p)[1])(p))  # noqa: E731
    with sharding_rules(sparse.mesh, sparse.cfg.mesh.rules):
        token_grads, kl_grads = jax.jit(both)(params)
    nonzero = lambda tree: [bool(np.any(np.asarray(x))) for x in jax.tree.leaves(tree)]  # noqa: E731
    token_indexers, token_rest = split_indexers(jax.device_get(token_grads))
    kl_indexers, kl_rest = split_indexers(jax.device_get(kl_grads))
    assert not any(nonzero(token_indexers)) and all(nonzero(kl_indexers))
    assert not any(nonzero(kl_rest)) and any(nonzero(token_rest))


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["model.mla.indexer.stage=warmup"], "stage=warmup needs checkpoint.load_parameters_"),
        (["optim.qk_clip_threshold=100"], "indexer does not work with optim.qk_clip_threshold"),
        (["mesh.stage=2"], "indexer does not work with pipeline stages"),
        ([*WARMUP, "lora.rank=4"], "indexer does not work with lora, in the warm-up"),
        (["model.mla.q_lora_rank=null"], "model.mla.indexer needs model.mla.q_lora_rank"),
        (["model.mla.indexer.head_dim=4"], r"head_dim \(4\) must be at least"),
    ],
)
def test_bad_indexer_configs_are_refused_in_one_line(make_cfg, overrides, error):
    with pytest.raises(ConfigError, match=error):
        make_cfg(*INDEXER, *overrides)
