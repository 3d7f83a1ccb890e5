"""data.kind megatron: the train loop's batches from Megatron corpora, in Megatron's order.

Global batch t holds samples t*B .. t*B + B - 1 of the train split (B = train.global_batch_size),
in that row order, exactly as Megatron-LM's pretraining sampler hands them out: step t of a
maxtrain run sees what step t of a Megatron run with the same seed, sequence length, global
batch, sample counts and blend sees (the README lists the flags). One source is Megatron's
`--data-path PREFIX`; several are the weighted blend `--data-path W1 P1 W2 P2 ...`.

Sample counts follow Megatron-LM's pretrain_gpt, because they decide the epochs and so the
shuffle: train train.steps * B, valid (steps // eval_every + 1) * eval_steps * B. The test split
is never read, so it is not built.

Per-host reading and resume. Samples are addressed by index, so a host reads only its rows
(`host_rows`) of each step and nothing before it. The train iterator is a grain pipeline over a
random-access source of global batches, and its state is the next step alone: the same on every
host, it restores on any number of hosts (the rows each host reads follow from the process
count), and a restore costs nothing but reopening the source at that step.

Eval: each source's own valid-split GPTDataset (the one Megatron builds inside the blend), read
from its first sample at every eval, like maxtrain's other sources; `eval/<source>/loss` per
source and `eval/loss` their weighted mean. (Megatron's own eval instead continues through the
blended valid split from one eval to the next.)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np

from maxtrain.config import Config
from maxtrain.data import host_rows
from maxtrain.data.errors import DataError
from maxtrain.data.grain_pipeline import Batch, EvalStream, prefetch
from maxtrain.data.megatron import blend, checks, gpt_indices
from maxtrain.data.megatron.batches import TokenHandling, to_batch
from maxtrain.data.megatron.cache import cached, file_identity
from maxtrain.data.megatron.indexed import IndexedCorpus, bin_path, idx_path, open_corpus
from maxtrain.data.megatron.samples import BlendedSamples, GptSamples
from maxtrain.training import compile_cache

Samples = GptSamples | BlendedSamples
# Batches are read in the iterating thread; parallelism comes from prefetch()'s thread or workers.
_IN_THREAD = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def sample_counts(cfg: Config) -> dict[str, int]:
    """Megatron-LM's train and valid sample counts (its get_train_valid_test_num_samples)."""
    t = cfg.train
    evals = t.steps // t.eval_every + 1 if t.eval_every else 0
    return {
        "train": t.steps * t.global_batch_size,
        "valid": evals * t.eval_steps * t.global_batch_size,
    }


class MegatronData:
    """A config's corpora, checked, and the train and valid samples Megatron would build."""

    def __init__(self, cfg: Config):
        data = cfg.data
        self.seq_len = cfg.train.seq_len
        self.split = data.megatron.split
        self.seed = cfg.run.seed if data.shuffle_seed is None else data.shuffle_seed
        if not 0 <= self.seed < 2**32:
            raise DataError(
                f"seed {self.seed} (run.seed, or data.shuffle_seed) is not one Megatron can use: "
                "numpy.random.RandomState takes 0 <= seed < 2**32"
            )
        root = Path(data.cache_dir) if data.cache_dir else compile_cache.root()
        self.cache_dir = root / "megatron"
        m = data.megatron
        self.handling = TokenHandling(
            m.eod_id, m.reset_position_ids, m.reset_attention_mask, m.eod_mask_loss
        )
        self.weights = {s.name: s.weight for s in data.sources}
        self.corpora = {
            s.name: self._open(s.name, s.path, cfg.model.vocab_size) for s in data.sources
        }
        self.counts = sample_counts(cfg)

    def _open(self, name: str, prefix: str, vocab_size: int) -> IndexedCorpus:
        try:
            corpus = open_corpus(Path(prefix).expanduser())
            checks.check_vocab(corpus, vocab_size, self.cache_dir)
            if self.handling.switches_on:
                checks.check_eod(corpus, self.handling.eod_id, self.handling.switches_on[0])
        except DataError as e:
            raise DataError(f"data.sources[{name}]: {e}") from None
        return corpus

    def source(self, name: str, split: str, num_samples: int) -> GptSamples:
        """One source's GPTDataset of a split, its indices from the cache or built."""
        corpus = self.corpora[name]
        documents = gpt_indices.split_ranges(self.split, corpus.num_sequences)[split]
        lengths = (
            [] if documents is None else corpus.sequence_lengths[documents.start : documents.stop]
        )
        if not np.any(lengths):
            raise DataError(
                f"data.sources[{name}]: data.megatron.split {self.split!r} leaves the {split} "
                f"split of its {corpus.num_sequences} sequences no tokens; give that split a "
                f"larger share"
                + (" or set train.eval_every=0 (no evaluation)" if split == "valid" else "")
            )
        description = {
            "idx": file_identity(idx_path(corpus.prefix)),
            "bin": file_identity(bin_path(corpus.prefix)),
            "documents": [documents.start, documents.stop],
            "num_samples": num_samples,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }
        build = functools.partial(
            gpt_indices.build,
            corpus.sequence_lengths,
            documents,
            num_samples,
            self.seq_len,
            self.seed,
        )
        arrays = cached(self.cache_dir, f"GPTDataset-{split}", description, lambda: vars(build()))
        return GptSamples(corpus, arrays, self.seq_len)

    def samples(self, split: str) -> dict[str, GptSamples]:
        """Each source's GPTDataset of the split, asked for as many samples as Megatron asks."""
        n = self.counts[split]
        if len(self.corpora) == 1:  # `--data-path PREFIX`: no blend, exactly n samples
            return {name: self.source(name, split, n) for name in self.corpora}
        sizes = blend.source_samples(list(self.weights.values()), n)
        return {
            name: self.source(name, split, k) for name, k in zip(self.corpora, sizes, strict=True)
        }

    def train(self) -> Samples:
        sources = list(self.samples("train").values())
        if len(sources) == 1:
            return sources[0]
        weights, n = list(self.weights.values()), self.counts["train"]
        arrays = cached(
            self.cache_dir, "BlendedDataset-train", {"weights": weights, "num_samples": n},
            lambda: vars(blend.build(weights, n)),
        )  # fmt: skip
        taken = np.bincount(arrays["dataset_index"], minlength=len(sources))
        for name, source, count in zip(self.corpora, sources, taken, strict=True):
            if count > len(source):  # Megatron raises here too
                raise DataError(
                    f"data.sources[{name}]: the blend takes {count} samples from it, more than "
                    f"the {len(source)} its GPTDataset holds"
                )
        return BlendedSamples(sources, arrays)


class GlobalBatches:
    """A grain data source: global batch t -> this host's rows of it, in the train step's layout.

    Row r of batch t is sample t * B + r; an index past the end wraps around (eval streams read
    as many batches as train.eval_steps asks, whatever the valid split's size).
    """

    def __init__(self, samples: Samples, rows: range, global_batch: int, handling: TokenHandling):
        self.samples, self.rows, self.global_batch = samples, rows, global_batch
        self.handling = handling

    def __len__(self) -> int:
        return len(self.samples) // self.global_batch

    def __getitem__(self, step: int) -> Batch:
        ids = (step * self.global_batch + np.arange(self.rows.start, self.rows.stop)) % len(
            self.samples
        )
        return to_batch(self.samples.windows(ids), self.handling)


class StepIterator(Iterator[Batch]):
    """This host's train batches from a step on, prefetched; its state is that step.

    The state {"step": t} is the same on every host, so it is saved once and restores on any
    number of hosts (maxtrain/checkpointing/data_state.py, JsonIteratorState).
    """

    def __init__(self, batches: GlobalBatches, step: int, num_workers: int, buffer_size: int):
        self.batches, self.num_workers, self.buffer_size = batches, num_workers, buffer_size
        self._open(step)

    def _open(self, step: int) -> None:
        ds = grain.MapDataset.source(self.batches)[step:].to_iter_dataset(_IN_THREAD)
        self._iterator = iter(prefetch(ds, self.num_workers, self.buffer_size))
        self.step = step

    def __next__(self) -> Batch:
        batch = next(self._iterator)
        self.step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.close()
        self._open(int(state["step"]))

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()


def _eval_batches(batches: GlobalBatches) -> Iterator[Batch]:
    return (batches[k] for k in itertools.count())


def megatron_streams(cfg: Config, start_step: int = 0) -> tuple[Iterator[Batch], list[EvalStream]]:
    """(train iterator from step start_step, one valid-split stream per source)."""
    data = MegatronData(cfg)
    rows, batch = host_rows(cfg), cfg.train.global_batch_size
    evals = []
    if cfg.train.eval_every:  # built first: a source whose valid split is empty fails early
        for name, samples in data.samples("valid").items():
            source = GlobalBatches(samples, rows, batch, data.handling)
            evals.append(
                EvalStream(name, data.weights[name], functools.partial(_eval_batches, source))
            )
    train = GlobalBatches(data.train(), rows, batch, data.handling)
    return StepIterator(train, start_step, cfg.data.num_workers, cfg.data.worker_buffer_size), evals
