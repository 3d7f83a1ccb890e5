"""Two processes on localhost read disjoint rows that together are exactly the single-process
global batch, both as host numpy batches and as the global jax.Array on the 8-device mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from support.data import BIG_VOCAB, random_docs, sources_override, write_source
from support.runs import free_port
from support.xla_env import xla_flags

from maxtrain import config as config_lib
from maxtrain.data import BATCH_KEYS
from maxtrain.data.grain_pipeline import Pipeline

NUM_PROCESSES, STEPS, TIMEOUT_S = 2, 3, 180

# Each process: join the cluster, take STEPS batches through the train loop's own entry point,
# save them, and check the global arrays they assemble against a single-process pipeline.
CHILD = """
import json, sys
import jax
import numpy as np
from jax.experimental import multihost_utils
from maxtrain import config as config_lib
from maxtrain.data import BATCH_KEYS, batch_sharding, host_rows, to_global
from maxtrain.data.grain_pipeline import Pipeline
from maxtrain.parallel.mesh import build_mesh
from maxtrain.data.streams import data_streams

port, pid, nproc, steps, out, overrides = sys.argv[1:7]
pid, nproc, steps = int(pid), int(nproc), int(steps)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", json.loads(overrides))
train, _ = data_streams(cfg)
local = [next(train) for _ in range(steps)]
rows = host_rows(cfg)
np.savez(out, rows=np.array([rows.start, rows.stop]),
         **{f"{k}_{s}": b[k] for s, b in enumerate(local) for k in BATCH_KEYS})

mesh = build_mesh(cfg.mesh)
assert mesh.size == 8 and len(jax.local_devices()) == 4, (mesh.size, jax.local_devices())
single = Pipeline(cfg, rows=range(cfg.train.global_batch_size)).train_iterator()
for batch in local:
    expected = next(single)
    for key, array in to_global(batch, batch_sharding(mesh, cfg.mesh.rules)).items():
        assert array.shape == expected[key].shape, (key, array.shape)
        gathered = multihost_utils.process_allgather(array, tiled=True)
        np.testing.assert_array_equal(gathered, expected[key], err_msg=key)
del train, single  # grain iterators still alive at interpreter teardown print tracebacks
multihost_utils.sync_global_devices("done")
print("child", pid, "ok", flush=True)
jax.distributed.shutdown()
"""


def run_processes(overrides: list[str], tmp_path: Path) -> list[Path]:
    """Starts the processes, waits for all (a failure or TIMEOUT_S stops the rest)."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(4),
    }
    port, outs = free_port(), [tmp_path / f"host{i}.npz" for i in range(NUM_PROCESSES)]
    logs = [tmp_path / f"host{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    for i in range(NUM_PROCESSES):
        args = [str(port), str(i), str(NUM_PROCESSES), str(STEPS), str(outs[i])]
        with logs[i].open("w") as log:  # a file, not a pipe: a chatty child can never block
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, *args, json.dumps(overrides)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for i, p in enumerate(procs):
        tail = logs[i].read_text()[-3000:]
        assert p.returncode == 0, f"process {i} (rc {p.returncode}, killed if < 0):\n{tail}"
    return outs


def test_two_processes_together_see_exactly_the_single_process_batches(tmp_path):
    specs = []
    for i, (name, lengths, weight) in enumerate([("web", (5, 40), 0.7), ("code", (30, 120), 0.3)]):
        docs = random_docs(i, 120, lengths, first_id=2 + i * 100_000)
        specs.append((name, write_source(tmp_path / name, docs, BIG_VOCAB), weight))
    overrides = [
        "model_name=tiny",
        f"model.vocab_size={BIG_VOCAB}",
        "data.kind=grain",
        sources_override(specs),
        "data.packing=first_fit",
        "train.global_batch_size=8",
        "train.seq_len=32",
        "train.eval_every=0",
    ]
    outs = run_processes(overrides, tmp_path)

    cfg = config_lib.load(config_lib.CONFIGS_DIR / "base.yml", overrides)
    single = Pipeline(cfg, rows=range(8)).train_iterator()
    hosts = [np.load(out) for out in outs]
    assert [h["rows"].tolist() for h in hosts] == [[0, 4], [4, 8]]  # host_rows: in process order
    for step in range(STEPS):
        expected = next(single)
        for key in BATCH_KEYS:
            joined = np.concatenate([h[f"{key}_{step}"] for h in hosts])
            np.testing.assert_array_equal(joined, expected[key], err_msg=f"{key} step {step}")
