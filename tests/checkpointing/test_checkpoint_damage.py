"""Damaged and failing checkpoints on CPU with real Orbax writes: corruption and flipped bits
fall back to the newest intact step and say so, mistakes touch nothing, failures neither hang
nor wait on a slow tier."""

from __future__ import annotations

import json
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.checkpoints import (
    CORRUPTIONS,
    abstract,
    grain_iterator,
    largest_data_file,
    random_state,
    with_step,
)
from support.runs import tree_digest

from maxtrain import config as config_lib
from maxtrain.checkpointing import (
    Checkpointer,
    CheckpointError,
    checksums,
    integrity,
    load_parameters,
)


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
    largest_data_file(cfg.run_dir / "checkpoints" / "local" / "10").write_bytes(b"x")
    with checkpointer() as ckpt, pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.restore_latest(abstract(state))


def test_shape_mismatch_names_param_and_touches_nothing(setup, make_cfg):
    cfg, state, _, checkpointer = setup()
    with checkpointer() as ckpt:
        ckpt.save_now(10, state, grain_iterator(), tier="local")
        ckpt.save_now(20, state, grain_iterator(), tier="persistent")
    before = tree_digest(cfg.run_dir)

    other = random_state(make_cfg("model.emb_dim=32"))  # a different model
    with checkpointer() as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(abstract(other), grain_iterator())
    msg = str(err.value)
    assert "'params/embedding' has shape (256, 64) in the checkpoint" in msg
    assert "the model expects (256, 32)" in msg and "\n" not in msg
    assert tree_digest(cfg.run_dir) == before

    with pytest.raises(CheckpointError, match="'params/embedding' has shape"):
        load_parameters(cfg.run_dir / "checkpoints" / "local", abstract(other.params))
    assert tree_digest(cfg.run_dir) == before


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
    before = tree_digest(cfg.run_dir)

    other_cfg = make_cfg(override)
    other = Checkpointer(other_cfg.checkpoint, other_cfg.run_dir, config_lib.to_yaml(other_cfg))
    with other as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore_latest(abstract(random_state(other_cfg)))
    msg = str(err.value)
    assert f"holds the state of another optimizer ({named})" in msg
    step_dir = cfg.run_dir / "checkpoints" / "local" / "10"
    assert msg.endswith(f"checkpoint.load_parameters_path={step_dir}") and "\n" not in msg
    assert tree_digest(cfg.run_dir) == before


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
