"""Measures the input pipeline alone: tokens/s through read, mix, pack and batch.

    python tools/benchmark_data.py CONFIG.yml [key=value ...] [--batches N] [--warmup W]
    python tools/benchmark_data.py CONFIG.yml [key=value ...] --compare-megatron

Builds this host's train iterator exactly as the train loop does
(`maxtrain.training.loop.data_streams`)
and pulls batches as fast as it can. Prints one JSON line: tokens/s for the host and per host
core (the pipeline's workers share the host's cores), and the median time per batch.

--compare-megatron: for a grain config, also writes its sources' documents (the same token ids,
EOS as the end-of-document token) as Megatron corpora into a temporary directory and measures
data.kind megatron on them with the same batch shape: a second JSON line, same tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from maxtrain import config as config_lib
from maxtrain.common.errors import (
    ArgumentParser,
    UserError,
    non_negative_int,
    positive_int,
    refuse,
)
from maxtrain.data.grain_pipeline import resolve_sources
from maxtrain.data.megatron.indexed import IndexedWriter, token_dtype
from maxtrain.data.shards import read_shard, validate_source
from maxtrain.data.streams import data_streams


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
        "packing": cfg.data.packing if cfg.data.kind == "grain" else None,
        "num_workers": cfg.data.num_workers,
        "host_batch": list(batch["inputs"].shape),
        "batches": batches,
        "tokens_per_sec": round(tokens / elapsed),
        "host_cores": cores,
        "tokens_per_sec_per_core": round(tokens / elapsed / cores),
        "median_batch_ms": round(1e3 * statistics.median(times), 3),
    }


def megatron_overrides(cfg: config_lib.Config, out_dir: Path) -> list[str]:
    """Writes the config's grain sources as Megatron corpora in out_dir; the overrides that read
    them with data.kind megatron (same weights, EOS as the end-of-document id)."""
    listed = []
    for source in resolve_sources(cfg.data, cfg.model.vocab_size, cfg.train.seq_len + 1):
        metadata = validate_source(source.shards[0]).metadata
        writer = IndexedWriter(out_dir / source.name, token_dtype(metadata["vocab_size"]))
        for shard in source.shards:
            for document in read_shard(Path(shard)):
                writer.add_document(document)
        writer.finish()
        listed.append(
            {"name": source.name, "path": str(out_dir / source.name), "weight": source.weight}
        )
    return [
        "data.kind=megatron",
        "data.sources=" + json.dumps(listed),
        f"data.megatron.eod_id={metadata['eos_id']}",
        f"data.cache_dir={out_dir / 'cache'}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="benchmark_data", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--batches", type=positive_int, default=200)
    parser.add_argument("--warmup", type=non_negative_int, default=5)
    parser.add_argument("--compare-megatron", action="store_true", help="see the docstring")
    args = parser.parse_args(argv)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        print(json.dumps(benchmark(cfg, args.batches, args.warmup)), flush=True)
        if args.compare_megatron:
            with tempfile.TemporaryDirectory() as tmp:
                extra = megatron_overrides(cfg, Path(tmp))
                megatron = config_lib.load(args.config, [*args.overrides, *extra])
                print(json.dumps(benchmark(megatron, args.batches, args.warmup)))
    except UserError as e:
        return refuse("benchmark_data", e)
    return 0
