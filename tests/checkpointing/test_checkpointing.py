"""Checkpoints on CPU with real Orbax writes: exact round trip, tier policy, resharding,
retention, parameter import, the emergency tiers' choice (damage: test_checkpoint_damage.py)."""

from __future__ import annotations

import os
import shutil

import jax
import pytest
from support.checkpoints import (
    CORRUPTIONS,
    abstract,
    assert_bit_equal,
    grain_iterator,
    random_state,
    randomize,
    with_step,
)
from support.runs import tree_digest

from maxtrain import config as config_lib
from maxtrain.checkpointing import (
    Checkpointer,
    CheckpointError,
    EmergencyCheckpointer,
    integrity,
    load_parameters,
    read_saved_config,
    sidecar,
)
from maxtrain.checkpointing.emergency import choose

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


# ---- user mistakes and storage failures -------------------------------------------------------


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
        before = tree_digest(root)
        other = random_state(make_cfg(*common, "model.emb_dim=32"))
        with pytest.raises(CheckpointError, match="'params/embedding' has shape"):
            ckpt.restore_latest(abstract(other))
        assert tree_digest(root) == before

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
