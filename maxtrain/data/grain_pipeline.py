"""Grain input pipeline: weighted mixtures of prepared sources, packed, read per host, resumable.

The pipeline is one *stream* per row of the global batch (B rows):

    per source:  shards -> its train (or held-out) documents -> shuffle -> repeat
    per stream:  every B-th document of each source -> mix by weight -> pack into rows
    per host:    zip the streams of this host's rows -> [rows, seq_len] batch -> prefetch

Per-host reading. Row r of every global batch is the next packed row of stream r, and stream r
reads documents r, r + B, r + 2B, ... of each source's shuffled order. A host builds only the
streams of its own rows (`maxtrain.data.host_rows`), so it reads and packs 1/P of the data,
and no stream depends on the process count P: the hosts' batches, concatenated in process
order, are exactly the global batch a single process builds (tests/data/test_grain_multiprocess.py).
The price is B independent packers; each holds at most `first_fit_bins` partial rows.

Token shares. grain mixes per element, that is per document, so a source of long documents
would get more than its share of tokens. Weights in the config are token shares; each is
turned into a document weight w_tok / mean_doc_len (from the shard metadata), which makes the
expected tokens per mixed document proportional to w_tok. grain rounds the weights to integer
proportions with the smallest at 100, so shares are exact to about 1% of the smallest.

Held-out split. A document is held out when a hash of (source name, record index) falls below
`eval_fraction`: fixed for a given source, disjoint from training, and independent of seeds,
process count and the other sources. Renaming a source or reordering its shards changes it.

Determinism and exact resume. The same config gives the same batches on any run. The train
iterator is a grain DatasetIterator: `get_state()` is a JSON-serialisable dict, and
`set_state(state)` on a fresh pipeline continues exactly where the saved one stopped. For that
these must match the saved run: the sources (names, shard lists, weights), eval_fraction, the
shuffle seed, packing and first_fit_bins, train.seq_len, train.global_batch_size, the process
count (a host's state holds its own streams), and num_workers (each grain worker packs a
strided slice of every stream, so the row order depends on the worker count: 0 and 2 workers
give different, equally valid data). worker_buffer_size may change.

Fine-tuning sources (data/chat.py). A `chat` source is a JSONL file of conversations, tokenized
in memory when the pipeline is built; its documents carry a second feature, a loss flag per
token (1 on the assistant's tokens), packed alongside the tokens, and `rows_to_batch` keeps
loss_mask only where it is 1. Prepared documents mixed with chat get the flag as all ones.
Weights remain token shares, context tokens included. A `preference` source (train.task dpo)
is rows already, one pair each, and is not packed.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from maxtrain.common import absl_flags
from maxtrain.config import Config, DataConfig
from maxtrain.config.data import DataSource
from maxtrain.data import chat, host_rows, packing, shards
from maxtrain.data.errors import DataError
from maxtrain.data.synthetic import SyntheticText
from maxtrain.tokenizers import DEFAULT_TOKENIZER

Batch = dict[str, np.ndarray]
EMBEDDED_PREFIX = "embedded:"
# Streams read in the thread that iterates them: a host runs many streams, and per-stream read
# threads would multiply; parallel reading comes from num_workers (grain worker processes).
_IN_THREAD = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclass(frozen=True)
class Source:
    """A configured source resolved against its shard files."""

    name: str
    weight: float  # share of training tokens, as configured
    shards: tuple[str, ...]  # sorted: record indices (and so the held-out split) follow it
    documents: int
    tokens: int  # EOS included, as the pipeline reads them
    format: str = "tokens"  # chat / preference: `examples` holds it, tokenized (data/chat.py)
    examples: Any = None

    @property
    def mean_doc_len(self) -> float:
        return self.tokens / self.documents


@dataclass(frozen=True)
class EvalStream:
    """A held-out stream: `batches()` starts a fresh iterator, so every eval sees the same data."""

    name: str  # "" for a stream that is the whole eval set (synthetic)
    weight: float  # its share of the overall eval loss
    batches: Callable[[], Iterator[Batch]]


# ---- sources ----------------------------------------------------------------------------------


def resolve_sources(data: DataConfig, model_vocab_size: int, row_len: int) -> list[Source]:
    """Checks every source's shards and tokenizer; DataError naming the source and file. Chat
    and preference sources are read and tokenized here, whole."""
    embedded = _embedded_dirs(data)
    resolved = []
    for s in data.sources:
        if s.format != "tokens":
            resolved.append(_fine_tuning_source(s, data, model_vocab_size, row_len))
            continue
        path = embedded[s.path] if s.path in embedded else s.path
        try:
            info = shards.validate_source(path)
            metadata = info.metadata
            if s.path in embedded:  # the shared cache may be built by another checkout
                metadata = {**metadata, "tokenizer": str(DEFAULT_TOKENIZER)}
            shards.check_vocab(metadata, model_vocab_size)
        except DataError as e:
            raise DataError(f"data.sources[{s.name}]: {e}") from None
        resolved.append(
            Source(s.name, s.weight, tuple(map(str, info.shards)), info.documents, info.tokens)
        )
    return resolved


def _fine_tuning_source(
    source: DataSource, data: DataConfig, model_vocab_size: int, row_len: int
) -> Source:
    """A chat or preference JSONL source, read, rendered and tokenized in memory (data/chat.py):
    every mistake in it surfaces here, before anything is compiled."""
    try:
        tokenizer = chat.load_tokenizer(data.tokenizer)
        shards.check_vocab(
            {"tokenizer": tokenizer.path, "vocab_size": tokenizer.vocab_size}, model_vocab_size
        )
        template = chat.load_template(data.chat_template)
        if source.format == "chat":
            examples = chat.chat_examples(source.path, template, tokenizer)
        else:
            examples = chat.preference_rows(source.path, template, tokenizer, row_len)
            if examples.dropped:
                print(
                    f"maxtrain: warning: data.sources[{source.name}]: {examples.dropped} of "
                    f"{examples.dropped + len(examples)} preference pairs do not fit a row of "
                    f"{row_len} tokens and are left out",
                    file=sys.stderr,
                )
    except DataError as e:
        raise DataError(f"data.sources[{source.name}]: {e}") from None
    return Source(
        source.name, source.weight, (), len(examples), examples.num_tokens, source.format, examples
    )


def _embedded_dirs(data: DataConfig) -> dict[str, str]:
    """{"embedded:prose": dir, ...}, building the embedded corpus on first use (cached)."""
    wanted = {s.path for s in data.sources if s.path.startswith(EMBEDDED_PREFIX)}
    if not wanted:
        return {}
    try:
        from maxtrain.data.corpora.embedded import SOURCES, ensure_embedded_corpus
    except ImportError as e:
        raise DataError(f"the embedded corpus is not available in this checkout ({e})") from None
    known = sorted(f"{EMBEDDED_PREFIX}{name}" for name in SOURCES)
    unknown = sorted(wanted - set(known))
    if unknown:  # before building the corpus (a minute on first use) for nothing
        raise DataError(
            f"data.sources: unknown embedded source {unknown[0]!r}; the embedded corpus has "
            f"{', '.join(known)}"
        )
    built = ensure_embedded_corpus(data.cache_dir)
    return {f"{EMBEDDED_PREFIX}{name}": str(path) for name, path in built.items()}


def held_out(name: str, documents: int, fraction: float) -> np.ndarray:
    """[documents] bool, True for held-out documents: splitmix64 of (crc32(name), index)."""
    z = np.arange(documents, dtype=np.uint64) + (np.uint64(zlib.crc32(name.encode())) << 32)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def document_weights(sources: list[Source]) -> list[float]:
    """Token-share weights -> per-document mixing weights (see the module docstring)."""
    return [s.weight / s.mean_doc_len for s in sources]


def derive_seed(*parts: int | str) -> int:
    """A uint32 seed from ints and strings, stable across runs, hosts and numpy versions."""
    words = [zlib.crc32(p.encode()) if isinstance(p, str) else p for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


class Documents:
    """The records of one source at the given indices (a grain RandomAccessDataSource).

    A top-level class, and the ArrayRecord reader is shared by reference: grain pickles the
    whole pipeline into each worker process.
    """

    def __init__(self, records: grain.sources.ArrayRecordDataSource, indices: np.ndarray):
        self.records, self.indices = records, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> bytes:
        return self.records[int(self.indices[i])]


def decode(record: bytes, loss: bool = False) -> dict[str, np.ndarray]:
    """One record (little-endian int32 ids, EOS last) -> {"tokens": [n] int32}; with loss, in
    a mixture with fine-tuning data, every token's loss flag too (all count)."""
    tokens = shards.decode_record(record).astype(np.int32)
    return {packing.FEATURE: tokens, **({packing.LOSS: np.ones_like(tokens)} if loss else {})}


# ---- the pipeline -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One source's documents as a stream reads them, with its mixing weight."""

    documents: Documents
    doc_weight: float
    shuffle_seed: int
    format: str  # of its source: tokens documents are decoded, the others come decoded


class Pipeline:
    """Builds this host's train and eval datasets for a config.

    `rows` are the rows of the global batch this host loads (default: `host_rows`).
    `num_epochs` (tests, tools) makes every source finite; None repeats forever.
    """

    def __init__(self, cfg: Config, rows: range | None = None, num_epochs: int | None = None):
        self.data = cfg.data
        self.row_len = cfg.train.seq_len + 1  # targets are inputs shifted by one
        self.num_streams = cfg.train.global_batch_size
        self.rows = host_rows(cfg) if rows is None else rows
        if not self.rows or self.rows.start < 0 or self.rows.stop > self.num_streams:
            raise ValueError(f"rows {self.rows} are not rows of a {self.num_streams}-row batch")
        self.seed = cfg.run.seed if self.data.shuffle_seed is None else self.data.shuffle_seed
        self.num_epochs = num_epochs
        self.sources = resolve_sources(self.data, cfg.model.vocab_size, self.row_len)
        self._records = {
            s.name: grain.sources.ArrayRecordDataSource(list(s.shards))
            if s.examples is None
            else s.examples
            for s in self.sources
        }
        # Chat documents carry per-token loss flags, and the documents mixed with them too.
        self.loss_flags = any(s.format == "chat" for s in self.sources)

    def split(self, source: Source, split: str) -> Documents:
        """The source's 'train' or 'eval' documents; DataError if there are none."""
        mask = held_out(source.name, source.documents, self.data.eval_fraction)
        indices = np.flatnonzero(mask if split == "eval" else ~mask)
        if not len(indices):
            raise DataError(
                f"data.sources[{source.name}] has no {split} documents: data.eval_fraction="
                f"{self.data.eval_fraction} of its {source.documents} documents are held out"
            )
        return Documents(self._records[source.name], indices)

    def train_parts(self) -> list[_Part]:
        weighted = [s for s in self.sources if s.weight > 0]  # weight 0: eval only
        return [
            _Part(self.split(s, "train"), w, derive_seed(self.seed, "train", s.name), s.format)
            for s, w in zip(weighted, document_weights(weighted), strict=True)
        ]

    def eval_parts(self, source: Source) -> list[_Part]:
        seed = derive_seed(self.seed, "eval", source.name)
        return [_Part(self.split(source, "eval"), 1.0, seed, source.format)]

    def stream_documents(self, part: _Part, stream: int) -> grain.IterDataset:
        """Documents stream, stream + B, ... of the source's shuffled (per epoch) order."""
        ds = grain.MapDataset.source(part.documents).shuffle(seed=part.shuffle_seed)
        ds = ds.repeat(self.num_epochs)[stream :: self.num_streams]
        if part.format == "tokens":
            ds = ds.map(functools.partial(decode, loss=self.loss_flags))
        return ds.to_iter_dataset(_IN_THREAD)

    def stream_rows(self, parts: list[_Part], stream: int) -> grain.IterDataset:
        """Packed rows of one stream: {"tokens", "tokens_segment_ids", "tokens_positions"},
        and "loss" with chat sources. Preference sources are rows already (a pair each)."""
        docs = [self.stream_documents(p, stream) for p in parts]
        if len(docs) > 1:
            docs = [grain.IterDataset.mix(docs, weights=[p.doc_weight for p in parts])]
        if parts[0].format == "preference":  # the config allows no other format beside it
            return docs[0]
        pack_seed = derive_seed(self.seed, "pack", stream)
        return packing.pack(
            docs[0],
            self.data.packing,
            self.row_len,
            self.data.first_fit_bins,
            pack_seed,
            self.loss_flags,
        )

    def batches(self, parts: list[_Part]) -> grain.IterDataset:
        """This host's rows of each global batch: a dict of [rows, seq_len] int32 arrays."""
        streams = [self.stream_rows(parts, r) for r in self.rows]
        zipped = grain.experimental.ZipIterDataset(streams, strict=False)
        return zipped.map(packing.rows_to_batch)

    def train(self) -> grain.IterDataset:
        return self.batches(self.train_parts())

    def eval(self) -> dict[str, grain.IterDataset]:
        """A held-out dataset per source (weight-0 sources too), packed like training."""
        return {s.name: self.batches(self.eval_parts(s)) for s in self.sources}

    def train_iterator(self) -> grain.DatasetIterator:
        """The train iterator with prefetching: `next()`, `get_state()`, `set_state()`."""
        return iter(prefetch(self.train(), self.data.num_workers, self.data.worker_buffer_size))


def prefetch(ds: grain.IterDataset, num_workers: int, buffer_size: int) -> grain.IterDataset:
    """Worker processes (num_workers > 0) or one background thread, so batches are ready when
    the train step asks; both keep the iterator's state exact. Workers end with the process
    that started them (exit_with_parent)."""
    if num_workers > 0:
        absl_flags.mark_parsed()  # grain's workers read them
        options = grain.MultiprocessingOptions(
            num_workers=num_workers, per_worker_buffer_size=max(buffer_size, 1)
        )
        watch = functools.partial(exit_with_parent, os.getpid())
        if _QUIET_TRACKER not in sys.warnoptions:
            # After a kill or an abort, multiprocessing's resource tracker frees the shared
            # memory and semaphores the workers held, and warns about each kind: four lines
            # after maxtrain's one. The freeing is wanted, the warning not. The tracker starts
            # with the first worker and takes this interpreter's -W options.
            sys.warnoptions.append(_QUIET_TRACKER)
        return ds.mp_prefetch(options, worker_init_fn=watch)
    if buffer_size > 0:
        return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=buffer_size)
    return ds


_QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


def exit_with_parent(parent: int, worker_index: int = 0, worker_count: int = 0) -> None:
    """Runs in each grain worker: ends it within a second of the trainer's death, however the
    trainer died.

    A SIGKILLed trainer runs no cleanup, and its workers used to live on, holding memory, and
    with them multiprocessing's resource tracker (it exits once every process holding its pipe
    has). A thread here polls the worker's parent process id, which changes when the parent
    dies (the worker is re-parented). prctl(PR_SET_PDEATHSIG) would be the Linux way, but it
    fires when the parent THREAD that started the worker ends, and grain starts workers from
    threads of its own.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# ---- the train loop's entry points (by data.kind) ---------------------------------------------


def grain_streams(cfg: Config, start_step: int = 0) -> tuple[Iterator[Batch], list[EvalStream]]:
    """(train iterator from step start_step, held-out streams per source).

    Without a saved iterator state, starting at a later step replays the skipped batches; a
    resumed run should `set_state` instead.
    """
    if cfg.train.eval_every and cfg.data.eval_fraction == 0:
        raise DataError(
            f"train.eval_every={cfg.train.eval_every} asks for evaluation but "
            "data.eval_fraction is 0; hold out some documents or set train.eval_every=0"
        )
    pipeline = Pipeline(cfg)
    evals = []
    if cfg.train.eval_every:  # built first: a source too small to hold any out fails early
        weights = {s.name: s.weight for s in pipeline.sources}
        evals = [EvalStream(n, weights[n], ds.__iter__) for n, ds in pipeline.eval().items()]
    train = pipeline.train_iterator()
    for _ in range(start_step):
        next(train)
    return train, evals


def synthetic_streams(cfg: Config, start_step: int = 0) -> tuple[Iterator[Batch], list[EvalStream]]:
    """Learnable generated text (no corpus): every row is a pure function of (seed, step, row)."""
    rows = host_rows(cfg)
    common: dict[str, Any] = dict(
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.train.seq_len,
        branching=cfg.data.synthetic_branching,
        seed=cfg.run.seed,
    )
    train = SyntheticText(**common, stream=0)
    held_out_text = SyntheticText(**common, stream=1)
    return train.batches(rows, start_step), [
        EvalStream("", 1.0, lambda: held_out_text.batches(rows))
    ]
