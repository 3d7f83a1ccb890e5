"""Reference corpora and samples for maxtrain's Megatron reader, with megatron-core as the oracle.

    python tools/make_megatron_fixtures.py [--output tests/fixtures/megatron]

Writes, into the output directory:

- corpora/{web,code,math}.{bin,idx}: small corpora written by Megatron's own
  IndexedDatasetBuilder (web and math uint16, code int32 with ids beyond uint16), documents of
  1 to ~600 tokens each ending in the end-of-document id EOD, so some are shorter than a sample
  and some longer than several;
- samples/<config>.npz and configs.json: for each config in CONFIGS (seeds, sequence lengths,
  a multi-epoch and a separate-final-epoch one, 2- and 3-way blends, split strings, the token
  handling switches), the token ids of the samples Megatron's GPTDataset or BlendedDataset
  yields at `sample_ids` (the first FIRST and the last LAST of the train split), the source of
  each (blends), each source's first valid samples (blends), and for the switches the
  loss_mask, position_ids and, per query, the first key the attention mask lets it see;
- prepared/: a corpus written by maxtrain's `tools/prepare_data.py --output-format
  megatron` from prepared/input.jsonl, and the tokens Megatron's IndexedDataset reads back from it
  (megatron_read.npz): the check that Megatron accepts what maxtrain writes.

The sample counts follow Megatron-LM's pretrain_gpt (get_train_valid_test_num_samples): train
train_iters * global_batch_size, valid (train_iters // eval_interval + 1) * eval_iters *
global_batch_size, test eval_iters * global_batch_size; each config names them in maxtrain's
terms (steps, global_batch_size, eval_every, eval_steps).

tests/data/test_megatron_data.py reads only these files (CI has no torch). The tool needs torch and
megatron-core, which maxtrain does not depend on; megatron-core 0.16.1 is the newest release for
Python 3.11, and the machine carries a CPU torch for 3.11, so it runs in its own environment:

    python3.11 -m venv /work/megatron-venv     # anywhere outside the repository
    /work/megatron-venv/bin/pip install torch==2.13.0      # pinned: the CPU build on disk
    /work/megatron-venv/bin/pip install megatron-core==0.16.1 numpy packaging
    /work/megatron-venv/bin/python tools/make_megatron_fixtures.py

The prepared/ step runs maxtrain's tool in maxtrain's own environment (--maxtrain-python,
default .venv/bin/python). This file imports nothing from maxtrain: it describes the Megatron
side independently.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO / "tests" / "fixtures" / "megatron"
EOD = 2  # ids 0 and 1 stay unused, so a zero-filled or padded window shows up as wrong
FIRST, LAST, VALID = 160, 32, 48
# name -> (dtype, documents, (min, max) length of a document before EOD, max token id + 1);
# a fixed seed per corpus. Lengths are drawn from three bands: short, medium and long.
CORPORA = {
    "web": ("uint16", 110, ((1, 24), (24, 160), (160, 600)), 256),
    "code": ("int32", 50, ((20, 80), (80, 300), (300, 500)), 70_000),
    "math": ("uint16", 180, ((1, 12), (12, 40), (40, 90)), 256),
}
# name -> config. sources: [[name, weight]]; one source without a weight is Megatron's
# `--data-path PREFIX` (no blend). The switches default to False.
CONFIGS: dict[str, dict] = {
    "web_s32": dict(sources=[["web", None]], seq_len=32, seed=1234, split="90,8,2",
                    steps=40, global_batch_size=8, eval_every=20, eval_steps=2),
    "web_s64_multi_epoch": dict(sources=[["web", None]], seq_len=64, seed=7, split="98,2,0",
                                steps=182, global_batch_size=8, eval_every=50, eval_steps=1),
    "math_s16_separate_final_epoch": dict(sources=[["math", None]], seq_len=16, seed=5,
                                          split="100,0,0", steps=52, global_batch_size=16,
                                          eval_every=0, eval_steps=1),
    "code_s48_int32": dict(sources=[["code", None]], seq_len=48, seed=3, split="90,10,0",
                           steps=30, global_batch_size=4, eval_every=10, eval_steps=2),
    "blend2_web_code": dict(sources=[["web", 0.7], ["code", 0.3]], seq_len=32, seed=1234,
                            split="90,8,2", steps=40, global_batch_size=8, eval_every=20,
                            eval_steps=2),
    "blend3_s64": dict(sources=[["web", 0.5], ["code", 0.3], ["math", 0.2]], seq_len=64,
                       seed=42, split="80,15,5", steps=75, global_batch_size=8, eval_every=25,
                       eval_steps=2),
    "math_s32_switches": dict(sources=[["math", None]], seq_len=32, seed=11, split="95,5,0",
                              steps=20, global_batch_size=8, eval_every=10, eval_steps=1,
                              reset_position_ids=True, reset_attention_mask=True,
                              eod_mask_loss=True),
    "web_math_s32_eod_mask_loss": dict(sources=[["web", 2.0], ["math", 1.0]], seq_len=32,
                                       seed=9, split="90,10,0", steps=30, global_batch_size=8,
                                       eval_every=10, eval_steps=1, eod_mask_loss=True),
}  # fmt: skip
SWITCHES = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
# Split strings and sequence counts whose ranges are recorded (Megatron's default among them,
# and counts where a bound lands on .5 and Python's round goes to the even side).
SPLIT_CASES = [("969,30,1", 110), ("969,30,1", 1000), ("969, 30, 1", 123_457), ("98,2", 75),
               ("1,1,1", 10), ("80,15,5", 50), ("100,0,0", 7), ("0.5,0.25,0.25", 6)]  # fmt: skip
# Megatron hangs on a split with a requested size but no sequences (its epoch loop never ends),
# so every config's splits hold sequences in every corpus it reads.


class FixtureTokenizer:
    """All of a tokenizer that GPTDataset reads: the vocabulary size, EOD and an identity."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod = vocab_size, EOD
        self.unique_identifiers = {"class": "FixtureTokenizer", "vocab_size": vocab_size}


def write_corpora(root: Path) -> dict[str, Path]:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefixes = {}
    for seed, (name, (dtype, count, bands, vocab)) in enumerate(CORPORA.items()):
        rng = np.random.default_rng(100 + seed)
        builder = IndexedDatasetBuilder(str(root / f"{name}.bin"), dtype=np.dtype(dtype).type)
        for band in rng.integers(0, len(bands), size=count):
            length = int(rng.integers(*bands[band]))
            doc = np.append(rng.integers(EOD + 1, vocab, size=length), EOD)
            builder.add_document(torch.from_numpy(doc), [len(doc)])
        builder.finalize(str(root / f"{name}.idx"))
        prefixes[name] = root / name
    return prefixes


def sample_counts(cfg: dict) -> list[int]:
    """Megatron-LM's get_train_valid_test_num_samples for the config's maxtrain keys."""
    batch, steps, eval_steps = cfg["global_batch_size"], cfg["steps"], cfg["eval_steps"]
    valid_iters = (steps // cfg["eval_every"] + 1) * eval_steps if cfg["eval_every"] else 0
    return [steps * batch, valid_iters * batch, eval_steps * batch]


def build_datasets(cfg: dict, prefixes: dict[str, Path], vocab_size: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    names = [n for n, _ in cfg["sources"]]
    weights = [w for _, w in cfg["sources"]]
    config = GPTDatasetConfig(
        random_seed=cfg["seed"],
        sequence_length=cfg["seq_len"],
        blend=([str(prefixes[n]) for n in names], None if weights == [None] else weights),
        split=cfg["split"],
        tokenizer=FixtureTokenizer(vocab_size),
        **{s: cfg.get(s, False) for s in SWITCHES},
    )
    sizes = sample_counts(cfg)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def window(sample: dict) -> np.ndarray:
    """The seq_len + 1 tokens a sample was cut from: its inputs plus the last label."""
    return np.append(sample["tokens"].numpy(), sample["labels"].numpy()[-1]).astype(np.int32)


def first_visible_key(attention_mask) -> np.ndarray:
    """[S]: per query, the first key it may attend to (Megatron's mask is True where masked)."""
    masked = attention_mask.numpy()[0]
    return np.argmin(masked, axis=1).astype(np.int16)


def record(name: str, cfg: dict, prefixes: dict[str, Path], out: Path) -> dict:
    train, valid, _ = build_datasets(cfg, prefixes, vocab_size=max(v for *_, v in CORPORA.values()))
    requested = sample_counts(cfg)[0]
    ids = np.unique(np.r_[np.arange(FIRST), np.arange(requested - LAST, requested)])
    samples = [train[int(i)] for i in ids]
    arrays = {"sample_ids": ids, "tokens": np.stack([window(s) for s in samples])}
    if "dataset_id" in samples[0]:
        arrays["dataset_ids"] = np.array([int(s["dataset_id"]) for s in samples], np.int16)
        for k, (source, _) in enumerate(cfg["sources"]):  # each source's own valid samples
            part = valid.datasets[k]
            count = min(VALID, len(part))
            arrays[f"valid_{source}"] = np.stack([window(part[i]) for i in range(count)])
    if any(cfg.get(s) for s in SWITCHES) or name == "web_s32":  # web_s32: the defaults
        arrays["loss_mask"] = np.stack([s["loss_mask"].numpy() for s in samples]).astype(np.int8)
        arrays["position_ids"] = np.stack([s["position_ids"].numpy() for s in samples])
        arrays["position_ids"] = arrays["position_ids"].astype(np.int32)
        arrays["first_key"] = np.stack([first_visible_key(s["attention_mask"]) for s in samples])
    np.savez_compressed(out / f"{name}.npz", **arrays)
    return {**cfg, "train_samples": len(train), "sample_counts": sample_counts(cfg)}


def prepared(out: Path, maxtrain_python: str) -> None:
    """maxtrain writes a corpus; Megatron's IndexedDataset must read it back token for token."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = out / "corpus"
    for suffix in (".bin", ".idx"):
        prefix.with_suffix(suffix).unlink(missing_ok=True)
    subprocess.run(
        [maxtrain_python, str(REPO / "tools" / "prepare_data.py"), "--input",
         str(out / "input.jsonl"), "--tokenizer",
         str(REPO / "maxtrain" / "data" / "assets" / "default.model"),
         "--output", str(prefix), "--output-format", "megatron"],
        check=True,
    )  # fmt: skip
    dataset = IndexedDataset(str(prefix))
    documents = [dataset[i] for i in range(len(dataset))]
    np.savez_compressed(
        out / "megatron_read.npz",
        lengths=np.array([len(d) for d in documents], np.int64),
        tokens=np.concatenate(documents).astype(np.int32),
        dtype=np.array(dataset.index.dtype.__name__),
        document_indices=np.asarray(dataset.document_indices),
    )


def split_ranges(split: str, num_sequences: int) -> list[list[int] | None]:
    """Megatron's split matrix for the string, applied to num_sequences as its builder does."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    # blended_megatron_dataset_builder._build_megatron_dataset_splits, verbatim in effect:
    return [
        None if m is None else [int(round(b * float(num_sequences))) for b in m] for m in matrix
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--maxtrain-python", default=str(REPO / ".venv" / "bin" / "python"))
    args = parser.parse_args(argv)
    (args.output / "corpora").mkdir(parents=True, exist_ok=True)
    (args.output / "samples").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # Megatron caches its indices beside the corpus
        prefixes = write_corpora(Path(tmp))
        for prefix in prefixes.values():
            for suffix in (".bin", ".idx"):
                shutil.copy(prefix.with_suffix(suffix), args.output / "corpora")
        configs = {name: record(name, cfg, prefixes, args.output / "samples")
                   for name, cfg in CONFIGS.items()}  # fmt: skip
    splits = [{"split": s, "sequences": n, "ranges": split_ranges(s, n)} for s, n in SPLIT_CASES]
    text = json.dumps({"eod": EOD, "configs": configs, "split_ranges": splits}, indent=1)
    (args.output / "configs.json").write_text(text + "\n")
    prepared(args.output / "prepared", args.maxtrain_python)


if __name__ == "__main__":
    main(sys.argv[1:])
