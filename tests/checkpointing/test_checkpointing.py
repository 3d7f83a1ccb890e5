"""Checkpoints on CPU with real Orbax writes: exact round trip, tier policy, corruption,
mistakes, resharding, failures that must not hang, retention, parameter import."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain.checkpointing import (
    Checkpointer,
    CheckpointError,
    EmergencyCheckpointer,
    checksums,
    integrity,
    load_parameters,
    read_saved_config,
    sidecar,
)
from maxtrain.checkpointing.emergency import choose
from maxtrain.parallel.mesh import build_mesh, sharding_rules
from maxtrain.training.run_model import model_def
from maxtrain.training.state import TrainState, state_shardings


def random_state(cfg, devices=None, seed=0) -> TrainState:
    """A TrainState of the config's model, laid out as init_state lays it out, with random
    values in every leaf (nothing compiled: building the real one costs seconds per test)."""
    mesh = build_mesh(cfg.mesh, devices)
    tx, _ = optim.build(cfg.optim, cfg.train.steps)
    with sharding_rules(mesh, cfg.mesh.rules):
        mdef = model_def(cfg)
        shardings = state_shardings(mdef, cfg, mesh, tx)
    params = nnx.to_pure_dict(mdef.abstract_state)
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
    )
    return randomize(shapes, shardings, seed)


def randomize(state, shardings=None, seed=0):
    """Distinct random values in every leaf (floats and ints), with the given shardings."""
    shardings = shardings if shardings is not None else jax.tree.map(lambda x: x.sharding, state)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    out = []
    for x, sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        if jnp.issubdtype(x.dtype, jnp.floating):
            value = rng.standard_normal(x.shape).astype(x.dtype)
        else:
            value = rng.integers(0, 1000, x.shape).astype(x.dtype)
        out.append(jax.device_put(value, sharding))
    return jax.tree.unflatten(treedef, out)


def abstract(state, shardings=None):
    shardings = shardings if shardings is not None else jax.tree.map(lambda x: x.sharding, state)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def assert_bit_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def grain_iterator():
    return iter(grain.MapDataset.range(100).shuffle(seed=1).to_iter_dataset())


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def setup(make_cfg):
    """(cfg, trainer state with random values, log lines, Checkpointer factory)."""

    def make(*overrides: str, devices=None):
        cfg = make_cfg(
            "checkpoint.local.every_steps=10",
            "checkpoint.persistent.every_steps=20",
            *overrides,
        )
        state = random_state(cfg, devices)
        logs: list[str] = []

        def checkpointer(**kw):
            return Checkpointer(
                cfg.checkpoint, cfg.run_dir, config_lib.to_yaml(cfg), log=logs.append, **kw
            )

        return cfg, state, logs, checkpointer

    return make


def with_step(state, step):
    return state.replace(step=jax.device_put(np.int32(step), state.step.sharding))


# ---- round trip and tier policy ---------------------------------------------------------------


def test_round_trip_is_bit_exact_with_data_iterator(setup):
    cfg, state, _, checkpointer = setup()
    it = grain_iterator()
    consumed = [next(it) for _ in range(7)]
    with checkpointer() as ckpt:
        assert ckpt.maybe_save(10, state, it) == ["local"]
        assert ckpt.last_saved_step == 10
    expected_next = [next(it) for _ in range(5)]

    fresh = grain_iterator()
    with checkpointer() as ckpt:
        restored, step = ckpt.restore_latest(abstract(state), fresh)
        assert step == 10 and ckpt.restore_info["data_restored"]
        assert ckpt.restore_info["meta"]["seed"] == cfg.run.seed
    assert_bit_equal(restored, state)
    assert [next(fresh) for _ in range(5)] == expected_next
    assert consumed != expected_next[:5]


def test_json_state_iterator_round_trip(setup):
    class Counter:
        def __init__(self):
            self.i = 0

        def __next__(self):
            self.i += 1
            return self.i

        def get_state(self):
            return {"i": self.i}

        def set_state(self, s):
            self.i = s["i"]

    _, state, _, checkpointer = setup()
    it = Counter()
    for _ in range(3):
        next(it)
    with checkpointer() as ckpt:
        ckpt.save_now(5, state, it)
    fresh = Counter()
    with checkpointer() as ckpt:
        assert ckpt.restore_latest(abstract(state), fresh)[1] == 5
    assert next(fresh) == 4


def test_newest_complete_across_tiers_wins(setup):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(20, with_step(state, 20), tier="persistent")
        ckpt.save_now(30, with_step(state, 30), tier="local")
    with checkpointer() as ckpt:
        restored, step = ckpt.restore_latest(abstract(state))
        assert (step, int(restored.step), ckpt.restore_info["tier"]) == (30, 30, "local")
    shutil.rmtree(cfg.run_dir / "checkpoints" / "local")
    with checkpointer() as ckpt:
        restored, step = ckpt.restore_latest(abstract(state))
        assert (step, int(restored.step), ckpt.restore_info["tier"]) == (20, 20, "persistent")


def test_step_due_in_both_tiers_is_saved_once_to_the_persistent_tier(setup):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        assert ckpt.maybe_save(10, with_step(state, 10)) == ["local"]
        assert ckpt.maybe_save(20, with_step(state, 20)) == ["persistent"]  # one host copy
    steps = lambda tier: [s for s, _ in integrity.step_dirs(cfg.run_dir / "checkpoints" / tier)]
    assert steps("local") == [10] and steps("persistent") == [20]
    with checkpointer() as ckpt:
        restored, step = ckpt.restore_latest(abstract(state))
        assert (step, int(restored.step), ckpt.restore_info["tier"]) == (20, 20, "persistent")


def test_no_checkpoint_restores_nothing_and_writes_nothing(setup):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        assert ckpt.restore_latest(abstract(state)) is None
    assert not (cfg.run_dir / "checkpoints").exists()


def test_save_now_is_durable_on_return(setup):
    cfg, state, _, checkpointer = setup()
    ckpt = checkpointer()
    ckpt.save_now(7, state, tier="local", wait=True)
    step_dir = cfg.run_dir / "checkpoints" / "local" / "7"
    assert (step_dir / "commit_success.txt").is_file()  # committed before close()...
    integrity.verify(step_dir)  # ...and complete (raises Corrupt otherwise)
    ckpt.close()


# ---- corruption -------------------------------------------------------------------------------


def _largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


CORRUPTIONS = {
    "truncated array data": lambda d: _largest_data_file(d).write_bytes(b""),
    "deleted array data": lambda d: _largest_data_file(d).unlink(),
    "deleted iterator state": lambda d: (d / "data" / "process_0-of-1.json").unlink(),
    "deleted manifest": lambda d: (d / integrity.MANIFEST).unlink(),
    "deleted commit file": lambda d: (d / integrity.COMMIT_FILE).unlink(),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_newest_falls_back_and_says_so(setup, corruption):
    cfg, state, logs, checkpointer = setup("checkpoint.persistent.every_steps=1000")
    it = grain_iterator()
    with checkpointer() as ckpt:
        ckpt.maybe_save(10, with_step(state, 10), it)
        ckpt.maybe_save(20, with_step(state, 20), it)
    local = cfg.run_dir / "checkpoints" / "local"
    CORRUPTIONS[corruption](local / "20")

    with checkpointer() as ckpt:
        restored, step = ckpt.restore_latest(abstract(state), grain_iterator())
        assert (step, int(restored.step)) == (10, 10)
        assert any(
            line.startswith(f"checkpoint step 20 in {local} is incomplete or corrupt (")
            and line.endswith("); falling back to step 10")
            for line in logs
        ), logs
        # The corrupt step is moved aside (not deleted), so step 20 can be saved again.
        assert not (local / "20").exists() and list(local.glob("20.corrupt-*"))
        ckpt.maybe_save(20, with_step(state, 20), it)
    assert (local / "20" / integrity.COMMIT_FILE).exists()


def test_flipped_bit_restores_as_corrupt_naming_the_leaf_and_falls_back(setup, tmp_path):
    """A bit flipped in one optimizer moment, with every file still its listed size (what a bad
    disk does), is caught by the content checksums written at save time: the step is set
    aside and the run resumes from the one before, with one line naming the leaf."""
    cfg, state, logs, checkpointer = setup("checkpoint.persistent.every_steps=1000")
    with checkpointer() as ckpt:
        ckpt.maybe_save(10, with_step(state, 10))
        ckpt.maybe_save(20, with_step(state, 20))
    leaf = "opt_state/1/0/nu/layers/mlp/up/kernel"
    paths = checksums.paths(state)
    leaves, treedef = jax.tree.flatten(with_step(state, 20))
    i = paths.index(leaf)
    bits = np.asarray(leaves[i]).view(np.uint32).copy()
    bits.flat[537] ^= 1 << 3  # one low mantissa bit: the value stays finite and plausible
    leaves[i] = jax.device_put(bits.view(np.float32), leaves[i].sharding)
    flipped = jax.tree.unflatten(treedef, leaves)
    # The same step with the flipped bit, written elsewhere; its state replaces step 20's, and
    # step 20's manifest is made to list the new sizes, so only the checksums can tell.
    other = Checkpointer(cfg.checkpoint, tmp_path / "other", config_lib.to_yaml(cfg), log=print)
    with other:
        other.maybe_save(20, flipped)
    local = cfg.run_dir / "checkpoints" / "local"
    shutil.rmtree(local / "20" / "state")
    shutil.copytree(
        tmp_path / "other" / "checkpoints" / "local" / "20" / "state", local / "20" / "state"
    )
    manifest_path = local / "20" / integrity.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    theirs = json.loads((tmp_path / "other/checkpoints/local/20" / integrity.MANIFEST).read_text())
    assert manifest["checksums"][leaf] != theirs["checksums"][leaf]  # the bit changed the sum
    assert {k: v for k, v in manifest["checksums"].items() if k != leaf} == {
        k: v for k, v in theirs["checksums"].items() if k != leaf
    }
    manifest["files"] = {
        k: v
        for k, v in (manifest["files"] | theirs["files"]).items()
        if (k in theirs["files"]) == k.startswith("state/")
    }
    manifest_path.write_text(json.dumps(manifest))

    with checkpointer() as ckpt:
        restored, step = ckpt.restore_latest(abstract(state))
    assert (step, int(restored.step)) == (10, 10)
    assert any(
        line.startswith(f"checkpoint step 20 in {local} is incomplete or corrupt (")
        and repr(leaf) in line
        and line.endswith("); falling back to step 10")
        for line in logs
    ), logs
    assert list(local.glob("20.corrupt-*"))


def test_checksum_catches_every_single_bit_flip_and_ignores_the_layout():
    """Every single-bit change of an array changes its checksum, for each width the state
    holds; the checksum of a global array is the same on any sharding (a step saved on one
    mesh is checked on another)."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jnp.bfloat16, np.int8, np.int32):
        x = rng.integers(0, 100, (2, 4)).astype(dtype)
        base = checksums.of({"x": jnp.asarray(x)})["x"]
        raw = x.view(f"uint{8 * x.dtype.itemsize}")
        for i in range(raw.size):
            for b in range(8 * x.dtype.itemsize):
                flipped = raw.copy()
                flipped.flat[i] ^= 1 << b
                after = checksums.of({"x": jnp.asarray(flipped.view(x.dtype))})["x"]
                assert after != base, (dtype, i, b)
    int4 = jnp.arange(-8, 8, dtype=jnp.int4)  # PTQ's weights: a changed value changes the sum
    base = checksums.of([int4])
    assert all(checksums.of([int4.at[i].set(int4[i] ^ 1)]) != base for i in range(16))
    x = jnp.asarray(rng.standard_normal((8, 16)).astype(np.float32))
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P("a", "b")))
    assert checksums.of([sharded]) == checksums.of([x])


def test_interrupted_save_is_ignored_then_cleaned_up(setup):
    cfg, state, logs, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, with_step(state, 10))
    local = cfg.run_dir / "checkpoints" / "local"
    partial = local / f"20{integrity.TMP_SUFFIX}"  # what a kill mid-save leaves behind
    shutil.copytree(local / "10", partial)
    (partial / integrity.COMMIT_FILE).unlink()
    with checkpointer() as ckpt:
        assert ckpt.restore_latest(abstract(state))[1] == 10
        assert not logs  # not a corrupt checkpoint: it never claimed to be complete
        ckpt.save_now(20, with_step(state, 20), tier="local")
    assert not partial.exists() and (local / "20" / integrity.COMMIT_FILE).exists()


def test_all_checkpoints_corrupt_is_an_error(setup):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, state)
    _largest_data_file(cfg.run_dir / "checkpoints" / "local" / "10").write_bytes(b"x")
    with checkpointer() as ckpt, pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.restore_latest(abstract(state))


# ---- user mistakes and storage failures -------------------------------------------------------


def test_shape_mismatch_names_param_and_touches_nothing(setup, make_cfg):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, state, grain_iterator(), tier="local")
        ckpt.save_now(20, state, grain_iterator(), tier="persistent")
    before = tree_hash(cfg.run_dir)

    other = random_state(make_cfg("model.emb_dim=32"))  # a different model
    with checkpointer() as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(abstract(other), grain_iterator())
    msg = str(err.value)
    assert "'params/embedding' has shape (256, 64) in the checkpoint" in msg
    assert "the model expects (256, 32)" in msg and "\n" not in msg
    assert tree_hash(cfg.run_dir) == before

    with pytest.raises(CheckpointError, match="'params/embedding' has shape"):
        load_parameters(cfg.run_dir / "checkpoints" / "local", abstract(other.params))
    assert tree_hash(cfg.run_dir) == before


@pytest.mark.parametrize(
    "override, named",
    [
        ("optim.clip_norm=0", "optim.clip_norm 1.0 there, 0.0 here"),
        ("optim.name=muon", "optim.name adamw there, muon here"),
    ],
)
def test_another_optimizer_is_named_as_such_and_touches_nothing(setup, make_cfg, override, named):
    """optim.clip_norm 1.0 -> 0 drops the clipping stage from optax's chain, AdamW -> Muon
    swaps its state for a partition of two: every optimizer path changes while the parameters
    match. It used to be blamed on the model."""
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, state, tier="local")
    before = tree_hash(cfg.run_dir)

    other_cfg = make_cfg(override)
    other = Checkpointer(other_cfg.checkpoint, other_cfg.run_dir, config_lib.to_yaml(other_cfg))
    with other as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(abstract(random_state(other_cfg)))
    msg = str(err.value)
    assert f"holds the state of another optimizer ({named})" in msg
    step_dir = cfg.run_dir / "checkpoints" / "local" / "10"
    assert msg.endswith(f"checkpoint.load_parameters_path={step_dir}") and "\n" not in msg
    assert tree_hash(cfg.run_dir) == before


def _in_thread(fn, timeout_s=60.0):
    """Runs fn in a thread; fails the test if it has not returned within timeout_s."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"hung for {timeout_s} s"
    return box


def test_unwritable_directory_fails_fast_and_clearly(setup, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file, not a directory")
    bad_dir = blocker / "ckpt"
    _, state, _, checkpointer = setup(f"checkpoint.local.dir={bad_dir}")
    ckpt = checkpointer()
    start = time.perf_counter()
    box = _in_thread(lambda: ckpt.maybe_save(10, state))
    assert isinstance(box.get("error"), CheckpointError), box
    assert str(bad_dir) in str(box["error"]) and "\n" not in str(box["error"])
    assert time.perf_counter() - start < 10


def test_background_failure_is_raised_not_hung(setup):
    cfg, state, _, checkpointer = setup()
    ckpt = checkpointer()
    ckpt.maybe_save(10, state)
    ckpt.wait_until_finished()
    local = cfg.run_dir / "checkpoints" / "local"
    shutil.rmtree(local)
    local.write_text("the disk went away")  # every later write under it fails

    def save_then_wait():
        ckpt.maybe_save(30, state)
        ckpt.wait_until_finished()

    box = _in_thread(save_then_wait)
    assert isinstance(box.get("error"), CheckpointError), box
    assert str(local) in str(box["error"])
    _in_thread(lambda: ckpt.close())  # closing after a failure does not hang either


def test_slow_persistent_tier_is_skipped_not_waited_for(setup, monkeypatch):
    cfg, state, logs, checkpointer = setup("checkpoint.persistent.every_steps=10")
    release = threading.Event()
    real_write = integrity.write_manifest

    def slow_write(step_dir, step, *rest):
        if step_dir.parent.name == "persistent":
            release.wait(30)  # a bucket that takes its time
        real_write(step_dir, step, *rest)

    monkeypatch.setattr(integrity, "write_manifest", slow_write)
    ckpt = checkpointer()
    assert ckpt.maybe_save(10, state) == ["persistent"]  # both due: one host copy, one tier
    start = time.perf_counter()
    assert ckpt.maybe_save(20, state) == ["local"]  # the persistent tier is busy: local saves
    assert time.perf_counter() - start < 5
    assert any("skipping the persistent checkpoint of step 20" in line for line in logs)
    release.set()
    ckpt.close()
    steps = lambda tier: sorted(
        s for s, _ in integrity.step_dirs(cfg.run_dir / "checkpoints" / tier)
    )
    assert steps("local") == [20] and steps("persistent") == [10]


# ---- resharding, retention, parameter import --------------------------------------------------


def test_restore_onto_other_mesh_and_fewer_devices(setup, make_cfg):
    _, state, _, checkpointer = setup("mesh.fsdp=8")
    with checkpointer() as ckpt:
        ckpt.save_now(10, state)

    for overrides, devices in ((("mesh.data=2", "mesh.fsdp=4"), None), ((), jax.devices()[:4])):
        target = random_state(make_cfg(*overrides), devices, seed=5)
        with checkpointer() as ckpt:
            restored, _ = ckpt.restore_latest(abstract(target))
        assert_bit_equal(restored, state)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
            assert got.sharding == want.sharding


def test_retention_keeps_newest_and_milestones(setup):
    cfg, state, _, checkpointer = setup(
        "checkpoint.local.every_steps=5",
        "checkpoint.local.keep=2",
        "checkpoint.local.keep_every_steps=20",
        "checkpoint.persistent.every_steps=1000",
    )
    with checkpointer() as ckpt:
        for step in range(5, 45, 5):
            ckpt.maybe_save(step, state)
    kept = [s for s, _ in integrity.step_dirs(cfg.run_dir / "checkpoints" / "local")]
    assert sorted(kept) == [20, 35, 40]


def test_load_parameters_returns_params_only(setup):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, state)
        ckpt.save_now(20, with_step(randomize(state, seed=1), 20), tier="persistent")
    target = abstract(state.params)
    local = cfg.run_dir / "checkpoints" / "local"
    assert_bit_equal(load_parameters(local / "10", target), state.params)
    assert_bit_equal(load_parameters(local, target), state.params)
    newest = load_parameters(cfg.run_dir, target)  # both tiers: step 20 wins
    assert_bit_equal(newest, randomize(state, seed=1).params)
    assert jax.tree.structure(newest) == jax.tree.structure(state.params)

    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_parameters(cfg.run_dir / "nowhere", target)


def test_the_saved_config_reads_back_from_either_layout_and_damage_is_one_line(setup, tmp_path):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, state)
    step_dir = cfg.run_dir / "checkpoints" / "local" / "10"
    assert read_saved_config(step_dir) == config_lib.to_yaml(cfg)
    # The emergency layout: the state alone as item `default`, the config in the sidecar.
    persistent = tmp_path / "emergency" / "persistent"
    (persistent / "10" / integrity.EMERGENCY_STATE_ITEM).mkdir(parents=True)
    sidecar.write(persistent, 10, {sidecar.CONFIG: config_lib.to_yaml(cfg)})
    assert read_saved_config(persistent / "10") == config_lib.to_yaml(cfg)

    item = step_dir / integrity.CONFIG_ITEM / "metadata"
    item.write_text(item.read_text()[:20])  # truncated
    with pytest.raises(CheckpointError) as err:
        read_saved_config(step_dir)
    unreadable = f"{item}: the config saved with the checkpoint is unreadable (JSONDecodeError: "
    assert str(err.value).startswith(unreadable) and "\n" not in str(err.value)
    shutil.rmtree(item.parent)
    with pytest.raises(CheckpointError) as err:
        read_saved_config(step_dir)
    assert str(err.value) == f"{step_dir}: holds no saved config ({item})"


def test_disabled_checkpointer_does_nothing(setup):
    cfg, state, _, checkpointer = setup("checkpoint.enabled=false")
    with checkpointer() as ckpt:
        assert ckpt.maybe_save(20, state) == []
        assert ckpt.restore_latest(abstract(state)) is None
    assert not os.path.exists(cfg.run_dir / "checkpoints")


# ---- the emergency checkpointer's restore policy (emergency.py) -------------------------------


def report(process, local=(), persistent=(), plain=(), data=()):
    """One process's report, as EmergencyCheckpointer._vet makes it."""
    return {"process": process, "local": list(local), "persistent": list(persistent),
            "plain": list(plain), "data": list(data), "steps": [], "error": None}  # fmt: skip


def test_emergency_restore_agrees_on_the_newest_step_a_whole_replica_holds():
    replica_of = lambda process: process // 2  # 0, 1: replica 0 (persistent); 2, 3: replica 1
    all_data = range(0, 100, 10)
    reports = [
        report(0, persistent=[20], data=all_data),
        report(1, data=all_data),
        report(2, local=[30, 40], data=all_data),
        report(3, local=[30], data=all_data),  # 40 never committed here
    ]
    assert choose(reports, replica_of, need_data=True) == (30, "local", 1)
    reports[1]["data"] = [20]  # process 1's data position for 30 is missing
    assert choose(reports, replica_of, need_data=True) == (20, "persistent", None)
    assert choose(reports, replica_of, need_data=False) == (30, "local", 1)  # no iterator
    # A persistent step in checkpointer.py's layout carries its own data positions.
    reports[0]["persistent"] = reports[0]["plain"] = [20, 50]
    assert choose(reports, replica_of, need_data=True) == (50, "persistent", None)
    assert choose([report(0), report(1)], replica_of, need_data=True) == (None, None, None)


def test_emergency_restore_vets_steps_on_disk(make_cfg, tmp_path):
    """The restore path of emergency.py on real checkpoints, with one process standing in for
    all: a corrupt newest local step is reported and moved aside, a persistent step in
    checkpointer.py's layout is read, and another model fails first, touching nothing."""
    root = tmp_path / "ckpt"
    common = ("mesh.data=2", "mesh.fsdp=4", f"checkpoint.persistent.dir={root}/persistent")
    plain_cfg = make_cfg(*common, f"checkpoint.local.dir={root}/local/process_0")
    state = random_state(plain_cfg)
    with Checkpointer(plain_cfg.checkpoint, plain_cfg.run_dir) as ckpt:
        ckpt.save_now(10, with_step(state, 10), tier="local")
        ckpt.save_now(20, with_step(state, 20), tier="persistent")
        ckpt.save_now(30, with_step(state, 30), tier="local")
    local = root / "local" / "process_0"
    CORRUPTIONS["truncated array data"](local / "30")
    cfg = make_cfg(*common, f"checkpoint.local.dir={root}/local")
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    logs: list[str] = []
    with EmergencyCheckpointer(cfg.checkpoint, cfg.run_dir, mesh=mesh, log=logs.append) as ckpt:
        before = tree_hash(root)
        other = random_state(make_cfg(*common, "model.emb_dim=32"))
        with pytest.raises(CheckpointError, match="'params/embedding' has shape"):
            ckpt.restore_latest(abstract(other))
        assert tree_hash(root) == before

        restored, step = ckpt.restore_latest(abstract(state))
    assert (step, ckpt.restore_info["tier"]) == (20, "persistent")
    assert_bit_equal(restored, with_step(state, 20))
    assert any(
        line.startswith(f"checkpoint step 30 in {local} is incomplete or corrupt: ")
        and line.endswith("; using step 20")
        for line in logs
    ), logs
    assert sorted(p.name.split(".")[0] for p in local.iterdir()) == ["10", "30"]
    assert not (local / "30").exists()  # moved aside: Orbax would refuse to save 30 again
