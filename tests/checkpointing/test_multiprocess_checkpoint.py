"""A two-process run checkpoints through Orbax's emergency multi-tier manager, and a run killed
mid-way resumes from the local tier of the replica that holds it, bit-identical to a run that
was never interrupted.

Two real processes on localhost (gloo), 4 CPU devices each, joined through the `distributed.*`
keys of `python -m maxtrain.train`. The mesh is data=2 x fsdp=4: two data-parallel replicas,
one per process, so process 1 (replica 1) writes the local tier and process 0 (replica 0) the
persistent one. The data is the grain mixture, whose position differs per process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.runs import free_port
from support.xla_env import xla_flags

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain.checkpointing import Checkpointer, integrity, load_parameters, read_saved_config
from maxtrain.training.loop import run
from maxtrain.training.run_model import model_def
from maxtrain.training.state import SavedState

NUM_PROCESSES, STEPS, TIMEOUT_S = 2, 16, 150
ARGS = [
    "model_name=tiny",
    "model.vocab_size=1024",  # the embedded corpus's tokenizer
    "data.kind=grain",
    "data.packing=first_fit",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "mesh.data=2",
    "mesh.fsdp=4",
    "checkpoint.local.every_steps=4",
    "checkpoint.persistent.every_steps=1000",  # only the final step: a resume must use local
]


def launch(
    run_dir: Path,
    jax_cache: Path,
    *overrides: str,
    stop_when=None,
    sigterm_when=None,
    kill_one_when=None,
) -> list[tuple[int, str]]:
    """Runs the two processes (ARGS, then overrides) to the end, or kills both (SIGKILL) once
    stop_when(run_dir). Once sigterm_when(run_dir), process 1 alone gets a SIGTERM; once
    kill_one_when(run_dir), process 1 alone gets a SIGKILL and process 0 is left to notice.

    Returns (exit status, output) per process. Any process failing, or TIMEOUT_S passing,
    stops the others, so a hang fails the test instead of hanging it. Launches share jax's
    compilation cache (jax_cache): later ones load the executables instead of compiling.
    """
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(8 // NUM_PROCESSES),
        "JAX_COMPILATION_CACHE_DIR": str(jax_cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    attempt = len(list(run_dir.parent.glob(f"{run_dir.name}.*.log"))) // NUM_PROCESSES
    logs = [run_dir.parent / f"{run_dir.name}.{attempt}.{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    for i, log in enumerate(logs):
        cmd = [
            sys.executable, "-m", "maxtrain.train", str(config_lib.CONFIGS_DIR / "base.yml"),
            *ARGS, f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
            f"distributed.coordinator_address=127.0.0.1:{port}",
            f"distributed.num_processes={NUM_PROCESSES}", f"distributed.process_id={i}",
            *overrides,
        ]  # fmt: skip
        with log.open("w") as out:  # a file, not a pipe: a chatty child can never block
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if stop_when is not None and stop_when(run_dir):
                break
            if sigterm_when is not None and sigterm_when(run_dir):
                procs[1].send_signal(signal.SIGTERM)
                sigterm_when = None
            if kill_one_when is not None and kill_one_when(run_dir):
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait()
                kill_one_when = None
            failed = [p.poll() not in (None, 0) for p in procs]
            if (failed[0] or (failed[1] and kill_one_when is not None)) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.01)
    finally:
        # Signal every process before reaping any: killing and reaping one at a time gives the
        # survivor time to notice its lost peer and exit 1 by itself.
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs, strict=True)]


def assert_ok(results: list[tuple[int, str]]) -> None:
    for i, (rc, out) in enumerate(results):
        assert rc == 0, f"process {i} exited {rc}:\n{out[-3000:]}"


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed run re-logs steps after its checkpoint, the later line wins."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def abstract_state() -> SavedState:
    """The run's saved state as shapes, laid out on this (test) process's first device."""
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", ARGS)
    params = nnx.to_pure_dict(model_def(cfg).abstract_state)
    tx, _ = optim.build(cfg.optim, cfg.train.steps)
    shapes = SavedState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
    )
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)


def final_params(run_dir: Path, step: int = STEPS):
    step_dir = run_dir / "checkpoints" / "persistent" / str(step)
    return jax.device_get(load_parameters(step_dir, abstract_state().params))


def assert_same_params(a, b) -> None:
    for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y, err_msg=jax.tree_util.keystr(path))


def local_steps(run_dir: Path, process: int) -> list[int]:
    tier = run_dir / "checkpoints" / "local" / f"process_{process}"
    return sorted(s for s, _ in integrity.step_dirs(tier))


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, jax_cache) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    results = launch(run_dir, jax_cache)
    assert_ok(results)
    assert "emergency multi-tier manager does not apply" not in results[0][1]
    return run_dir


def test_replicas_split_the_tiers_and_the_state_reads_back_anywhere(straight):
    ckpts = straight / "checkpoints"
    # Replica 1 (process 1) kept the newest 2 local steps; replica 0 writes no local tier. The
    # final step, due in both tiers, is saved once: to the persistent tier.
    assert local_steps(straight, 1) == [8, 12] and local_steps(straight, 0) == []
    for step in (8, 12):  # each with our manifest, written once Orbax had committed it
        integrity.verify(ckpts / "local" / "process_1" / str(step))
    # Replica 0 wrote the final step to the persistent tier, with our manifest, and every
    # process its data position beside it.
    assert [s for s, _ in integrity.step_dirs(ckpts / "persistent")] == [STEPS]
    integrity.verify(ckpts / "persistent" / str(STEPS))
    side = ckpts / "persistent" / "sidecar" / str(STEPS)
    assert {p.name for p in side.iterdir()} == {
        "process_0-of-2.json", "process_1-of-2.json", "meta.json", "config.yml"
    }  # fmt: skip
    assert json.loads((side / "process_0-of-2.json").read_text()) != json.loads(
        (side / "process_1-of-2.json").read_text()
    )  # each process reads its own rows
    # One process with the plain Checkpointer reads the emergency layout (state item `default`).
    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", ARGS)
    with Checkpointer(cfg.checkpoint, straight) as ckpt:
        state, step = ckpt.restore_latest(abstract_state())
    assert step == STEPS and ckpt.restore_info["meta"]["step"] == STEPS
    assert_same_params(state.params, final_params(straight))


def test_the_config_saved_in_the_emergency_layout_reads_back(straight):
    """Its persistent step holds the state alone (item `default`); the config is the sidecar's."""
    step_dir = straight / "checkpoints" / "persistent" / str(STEPS)
    assert read_saved_config(step_dir) == (straight / "config.yml").read_text()


def test_stopped_killed_and_losing_a_peer_then_resumed_is_bit_exact(tmp_path, straight, jax_cache):
    """One two-process run, stopped three ways in turn and each time started again: SIGTERM to
    process 1 alone (both stop at one step, saved to the local tier, exit 0); SIGKILL to both
    once a later local step is committed (the resume restores from replica 1's local tier);
    SIGKILL to process 1 alone (process 0 notices and exits by itself, in bounded time). Every
    step's loss and the final parameters equal the uninterrupted run's. (One chain rather than
    a test per way: each start of two processes costs tens of seconds.)"""
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    stopped = launch(
        run_dir, jax_cache, sigterm_when=lambda _: metrics.exists() and len(losses(run_dir)) >= 2
    )
    assert_ok(stopped)  # both exit 0, though only process 1 was signalled
    out = stopped[0][1]
    step = int(out.split("SIGTERM: saved step ")[1].split()[0])
    assert 2 <= step < 8, out[-3000:]
    assert max(losses(run_dir)) == step  # process 0 stopped at the same step
    assert local_steps(run_dir, 1)[-1] == step  # durable on the fast tier

    committed = run_dir / "checkpoints" / "local" / "process_1" / "8" / integrity.COMMIT_FILE
    killed = launch(run_dir, jax_cache, stop_when=lambda _: committed.exists())
    assert all(rc == -signal.SIGKILL for rc, _ in killed), [rc for rc, _ in killed]
    assert f"resumed at step {step}" in killed[0][1]
    assert not (run_dir / "checkpoints" / "persistent" / str(STEPS)).exists()

    committed = run_dir / "checkpoints" / "local" / "process_1" / "12" / integrity.COMMIT_FILE
    started = time.monotonic()
    results = launch(
        run_dir,
        jax_cache,
        # A short heartbeat: when the dead peer is noticed through it, the wait is this long.
        "distributed.heartbeat_timeout_s=5",
        kill_one_when=lambda _: committed.exists(),
    )
    (rc0, out0), (rc1, _) = results
    resumed_at = int(out0.split("resumed at step ")[1].split()[0])
    assert 8 <= resumed_at < 12, out0[-3000:]
    assert f"restored step {resumed_at} from the local tier of replica 1" in out0
    assert rc1 == -signal.SIGKILL
    # It exits by itself, saying why: our one line when its next collective fails (exit 1),
    # or an abort (SIGABRT) by jax when the heartbeat timeout comes first, or by gloo when the
    # dead peer's half-sent message reaches it inside a collective.
    lost = "maxtrain: error: process 0 lost contact with the other processes" in out0
    aborted = any(
        why in out0
        for why in (
            "Terminating process because the JAX distributed service detected fatal",
            "gloo::EnforceNotMet",
        )
    )
    assert (rc0 == 1 and lost) or (rc0 == -signal.SIGABRT and aborted), out0[-3000:]
    assert time.monotonic() - started < 0.8 * TIMEOUT_S, out0[-3000:]
    assert not (run_dir / "checkpoints" / "persistent" / str(STEPS)).exists()

    resumed = launch(run_dir, jax_cache)
    assert_ok(resumed)
    assert "resumed at step " in resumed[0][1]
    assert losses(run_dir) == losses(straight)  # every step, exact float equality
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    assert_same_params(final_params(run_dir), final_params(straight))


def test_a_truncated_local_step_is_set_aside_and_the_previous_one_resumes_bit_exact(
    tmp_path, straight, jax_cache
):
    """The newest local step (12) of replica 1 loses a byte of its largest file after the
    commit (a bad disk), and the persistent tier has nothing newer (its final step removed):
    both processes agree on step 8, the bad copy is moved aside with a line saying why, and
    steps 9-16 come out bit-identical to the uninterrupted run's."""
    newest_local = 12
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "persistent" / str(STEPS))
    newest = ckpts / "local" / "process_1" / str(newest_local)
    largest = max((f for f in newest.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    os.truncate(largest, largest.stat().st_size - 1)

    resumed = launch(run_dir, jax_cache)
    assert_ok(resumed)
    out = resumed[0][1]
    said = re.search(
        rf"checkpoint step {newest_local} in (\S+) is incomplete or corrupt: (.*); using step 8",
        out,
    )
    assert said and said[1].endswith("process_1"), out[-3000:]  # process 0 speaks for both
    assert "restored step 8 from the local tier of replica 1" in out, out[-3000:]
    assert local_steps(run_dir, 1) == [8, 12]  # the bad 12 aside, a good one saved again
    assert losses(run_dir) == losses(straight)
    assert_same_params(final_params(run_dir), final_params(straight))


ACROSS_SLICES = {
    "one-slice": (),
    "two-slices-over-dcn": ("mesh.num_slices=2", "mesh.dcn.data=2", "mesh.data=1"),
    # pipeline stages across slices: each process holds one stage and needs the whole batch
    "pipeline-stages-over-dcn": ("mesh.num_slices=2", "mesh.dcn.stage=2", "mesh.data=1"),
}


@pytest.mark.parametrize("layout", ACROSS_SLICES)
def test_two_processes_train_exactly_like_one_process_on_the_same_mesh(
    tmp_path, straight, jax_cache, layout
):
    """The global batch, the mesh and so the losses do not depend on how many processes hold
    the 8 devices. Across slices, each process is one simulated slice, and data parallelism
    (mesh.dcn.data=2) or the pipeline's stages (mesh.dcn.stage=2) run across them."""
    slices = ACROSS_SLICES[layout]
    steps = STEPS
    if slices:  # a launch of its own: 6 steps show the same (steps 2-6 train, lr > 0)
        steps = 6
        slices = (*slices, f"train.steps={steps}")
        two_processes = tmp_path / "run"
        assert_ok(launch(two_processes, jax_cache, *slices, "checkpoint.enabled=false"))
    else:
        two_processes = straight
    cfg = config_lib.load(
        config_lib.CONFIGS_DIR / "base.yml",
        [*ARGS, *slices, "checkpoint.enabled=false", f"run.output_dir={tmp_path / 'one'}"],
    )
    run(cfg)  # this test process: one process, 8 devices
    one, two = losses(cfg.run_dir), losses(two_processes)
    assert sorted(one) == sorted(two) == list(range(1, steps + 1))
    np.testing.assert_allclose([one[s] for s in one], [two[s] for s in one], rtol=1e-6)


def test_joining_without_a_coordinator_or_cluster_is_one_line_and_exit_2(tmp_path):
    cmd = [sys.executable, "-m", "maxtrain.train", str(config_lib.CONFIGS_DIR / "base.yml"),
           *ARGS, f"run.output_dir={tmp_path}",
           "distributed.num_processes=2", "distributed.process_id=0"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        "maxtrain: error: could not join the distributed run (num_processes=2, process_id=0, "
        "initialization_timeout_s=300): coordinator_address should be defined.\n"
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "setting, message",
    [
        ("distributed.process_id=2", "distributed.process_id (2) must be below distributed.num"),
        ("distributed.coordinator_address=localhost", "coordinator_address must be host:port"),
        (
            "distributed.num_processes=0",
            "config key 'distributed.num_processes' must be > 0 (got 0)",
        ),
    ],
)
def test_distributed_settings_are_checked(setting, message):
    overrides = [*ARGS, "distributed.num_processes=2", setting]
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
        config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
