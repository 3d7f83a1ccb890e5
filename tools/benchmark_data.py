"""Measures the input pipeline alone: tokens/s through read, mix, pack and batch.

    python tools/benchmark_data.py CONFIG.yml [key=value ...] [--batches N] [--warmup W]

Builds this host's train iterator exactly as the train loop does (`maxtrain.train.data_streams`)
and pulls batches as fast as it can. Prints one JSON line: tokens/s for the host and per host
core (the pipeline's workers share the host's cores), and the median time per batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxtrain import config as config_lib  # noqa: E402
from maxtrain.data.errors import DataError  # noqa: E402
from maxtrain.train import data_streams  # noqa: E402


def benchmark(cfg: config_lib.Config, batches: int, warmup: int) -> dict:
    train_batches, _ = data_streams(cfg)
    for _ in range(warmup):  # start-up: corpus build/cache, worker start, first fills
        next(train_batches)
    times, tokens = [], 0
    start = time.perf_counter()
    for _ in range(batches):
        t0 = time.perf_counter()
        batch = next(train_batches)
        times.append(time.perf_counter() - t0)
        tokens += int(batch["inputs"].size)
    elapsed = time.perf_counter() - start
    cores = os.cpu_count() or 1
    return {
        "kind": cfg.data.kind,
        "packing": cfg.data.packing,
        "num_workers": cfg.data.num_workers,
        "host_batch": list(batch["inputs"].shape),
        "batches": batches,
        "tokens_per_sec": round(tokens / elapsed),
        "host_cores": cores,
        "tokens_per_sec_per_core": round(tokens / elapsed / cores),
        "median_batch_ms": round(1e3 * statistics.median(times), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_intermixed_args()
    try:
        cfg = config_lib.load(args.config, args.overrides)
        print(json.dumps(benchmark(cfg, args.batches, args.warmup)))
    except (config_lib.ConfigError, DataError) as e:
        print(f"benchmark_data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
