"""The grain pipeline on real ArrayRecord shards: layout, packing, mixture shares, determinism,
exact resume, the held-out split, per-host rows and config errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.data import BIG_VOCAB, EOS, random_docs, sources_override, write_source

from maxtrain.config import ConfigError
from maxtrain.data import BATCH_KEYS, shards
from maxtrain.data.errors import DataError
from maxtrain.data.grain_pipeline import Pipeline, held_out
from maxtrain.data.packing import SplitLongDocuments
from maxtrain.data.streams import data_streams
from maxtrain.training.loop import run


def grain_cfg(make_cfg, specs, *overrides: str):
    return make_cfg(
        "data.kind=grain", f"model.vocab_size={BIG_VOCAB}", sources_override(specs), *overrides
    )


def take(iterator, n: int) -> list[dict[str, np.ndarray]]:
    return [next(iterator) for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> list[tuple[str, Path, float]]:
    """Three sources with very different document lengths and disjoint token ids."""
    root = tmp_path_factory.mktemp("mixture")
    specs = [("short", (4, 13), 0.6), ("medium", (20, 61), 0.3), ("long", (60, 181), 0.1)]
    out = []
    for i, (name, lengths, weight) in enumerate(specs):
        docs = random_docs(i, 300, lengths, first_id=2 + i * 100_000)
        out.append((name, write_source(root / name, docs, BIG_VOCAB), weight))
    return out


# ---- layout and packing -------------------------------------------------------------------------


def test_batch_has_the_train_step_keys_shapes_and_dtypes(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture)  # 8 rows of 32 tokens
    batch = next(Pipeline(cfg).train_iterator())
    assert set(batch) == set(BATCH_KEYS)
    for key in BATCH_KEYS:
        assert batch[key].shape == (8, 32) and batch[key].dtype == np.int32, key
    assert (batch["segment_ids"][:, 0] == 1).all()


def test_split_long_documents_overlaps_chunks_by_one_token():
    doc = {"tokens": np.arange(10, 30, dtype=np.int32)}  # 20 tokens
    chunks = SplitLongDocuments(row_len=8).flat_map(doc)
    assert [c["tokens"].tolist() for c in chunks] == [
        list(range(10, 18)),
        list(range(17, 25)),
        list(range(24, 30)),
    ]
    assert SplitLongDocuments(row_len=8).flat_map({"tokens": np.arange(8)})[0]["tokens"].size == 8


def one_epoch_rows(make_cfg, tmp_path, packing: str):
    """(docs, batches) of one pass over hand-made documents, some over 3 rows long."""
    docs = random_docs(7, 40, (1, 100), first_id=2)  # rows hold 33 tokens (seq_len 32 + 1)
    path = write_source(tmp_path / "hand", docs, BIG_VOCAB, docs_per_shard=15)
    cfg = grain_cfg(
        make_cfg,
        [("hand", path, 1.0)],
        f"data.packing={packing}",
        "data.eval_fraction=0",
        "train.global_batch_size=1",  # one stream, so one pass yields every row
    )
    batches = list(Pipeline(cfg, num_epochs=1).train())
    return docs, batches


@pytest.mark.parametrize("packing", ["concat_then_split", "first_fit"])
def test_segments_positions_and_loss_mask_follow_documents(make_cfg, tmp_path, packing):
    docs, batches = one_epoch_rows(make_cfg, tmp_path, packing)
    next_of = {t: n for d in docs for t, n in zip(d, [*d[1:], EOS], strict=True)}
    for b in batches:
        seg, pos, mask = b["segment_ids"][0], b["positions"][0], b["loss_mask"][0]
        inputs, targets = b["inputs"][0], b["targets"][0]
        real = seg > 0
        assert seg[0] == 1 and real[: real.sum()].all()  # ids from 1; padding only at the end
        assert set(np.diff(seg[real]).tolist()) <= {0, 1}
        for t in np.flatnonzero(real):
            new_segment = t == 0 or seg[t] != seg[t - 1]
            assert pos[t] == (0 if new_segment else pos[t - 1] + 1)  # restart per document
            if mask[t]:  # the target is the next token of the same document
                assert inputs[t] != EOS and next_of[inputs[t]] == targets[t]
            elif t + 1 < len(seg):  # never trained across a segment edge or into padding
                assert seg[t + 1] != seg[t]
        assert not mask[~real].any() and not inputs[~real].any()


@pytest.mark.parametrize("packing", ["concat_then_split", "first_fit"])
def test_long_documents_are_split_not_dropped(make_cfg, tmp_path, packing):
    docs, batches = one_epoch_rows(make_cfg, tmp_path, packing)
    tokens_in = sorted(t for d in docs for t in [*d, EOS])
    transitions = sum(len(d) for d in docs)  # a document of n tokens + EOS has n transitions
    rows = [np.append(b["inputs"][0], b["targets"][0, -1]) for b in batches]  # the full row
    tokens_out = sorted(int(t) for r in rows for t in r if t != 0)
    trained = sum(int(b["loss_mask"].sum()) for b in batches)
    if packing == "concat_then_split":
        assert tokens_out == tokens_in  # every token exactly once
        # Only a transition cut by a row edge is not trained: at most one per edge.
        assert transitions - (len(batches) - 1) <= trained <= transitions
    else:  # chunks overlap by one token: every token present, every transition exactly once
        assert set(tokens_out) == set(tokens_in)
        assert trained == transitions


# ---- mixture ----------------------------------------------------------------------------------


def token_shares(batches, num_sources: int) -> np.ndarray:
    """Share of real tokens per source, each segment counted (EOS included) by its token ids."""
    counts = np.zeros(num_sources)
    for b in batches:
        for inputs, seg in zip(b["inputs"], b["segment_ids"], strict=True):
            for s in np.unique(seg[seg > 0]):
                toks = inputs[seg == s]
                ids = toks[toks != EOS]
                if ids.size:
                    counts[(int(ids[0]) - 2) // 100_000] += toks.size
    return counts / counts.sum()


@pytest.mark.parametrize("packing", ["concat_then_split", "first_fit"])
def test_realized_token_shares_match_the_weights(make_cfg, mixture, packing):
    cfg = grain_cfg(make_cfg, mixture, f"data.packing={packing}", "data.eval_fraction=0")
    shares = token_shares(take(Pipeline(cfg).train_iterator(), 150), 3)
    weights = np.array([w for _, _, w in mixture])
    np.testing.assert_allclose(shares, weights, atol=0.02)
    # Mixing documents by the raw weights would be far off: mean lengths are ~9, ~41, ~121.
    naive = weights * np.array([9.5, 41.0, 121.0])
    assert np.abs(naive / naive.sum() - weights).max() > 0.2


def test_a_weight_zero_source_is_evaluated_but_never_trained_on(make_cfg, mixture):
    specs = [(n, p, w) for (n, p, _), w in zip(mixture, (0.5, 0.5, 0.0), strict=True)]
    pipeline = Pipeline(grain_cfg(make_cfg, specs, "data.packing=first_fit"))
    assert token_shares(take(pipeline.train_iterator(), 20), 3)[2] == 0
    assert sorted(pipeline.eval()) == ["long", "medium", "short"]


# ---- determinism and resume -------------------------------------------------------------------


def test_same_config_gives_the_same_batches_and_the_seed_changes_them(make_cfg, mixture):
    first = take(Pipeline(grain_cfg(make_cfg, mixture)).train_iterator(), 5)
    again = take(Pipeline(grain_cfg(make_cfg, mixture)).train_iterator(), 5)
    assert_same(first, again)
    other = take(Pipeline(grain_cfg(make_cfg, mixture, "run.seed=1")).train_iterator(), 5)
    assert not all(
        np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other, strict=True)
    )
    own = take(Pipeline(grain_cfg(make_cfg, mixture, "data.shuffle_seed=1")).train_iterator(), 5)
    assert_same(own, other)  # data.shuffle_seed overrides run.seed for the data only


@pytest.mark.parametrize("packing", ["concat_then_split", "first_fit"])
def test_restored_iterator_continues_exactly(make_cfg, mixture, packing):
    cfg = grain_cfg(make_cfg, mixture, f"data.packing={packing}", "data.first_fit_bins=3")
    original = Pipeline(cfg).train_iterator()
    take(original, 7)
    state = json.loads(json.dumps(original.get_state()))  # what a checkpoint stores
    expected = take(original, 5)
    restored = Pipeline(cfg).train_iterator()
    restored.set_state(state)
    assert_same(take(restored, 5), expected)


def test_worker_processes_are_deterministic_and_resume_exactly(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture, "data.num_workers=2")
    original = Pipeline(cfg).train_iterator()
    first = take(original, 3)
    state = json.loads(json.dumps(original.get_state()))
    expected = take(original, 3)
    restored = Pipeline(cfg).train_iterator()
    restored.set_state(state)
    assert_same(take(restored, 3), expected)
    fresh = Pipeline(cfg).train_iterator()
    assert_same(take(fresh, 3), first)
    for it in (original, restored, fresh):
        it.close()


# ---- hosts and the held-out split -------------------------------------------------------------


def test_hosts_rows_together_are_the_single_host_batch(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture, "data.packing=first_fit")
    whole = take(Pipeline(cfg, rows=range(0, 8)).train_iterator(), 4)
    halves = [
        take(Pipeline(cfg, rows=rows).train_iterator(), 4) for rows in (range(4), range(4, 8))
    ]
    joined = [
        {k: np.concatenate([h0[k], h1[k]]) for k in BATCH_KEYS}
        for h0, h1 in zip(*halves, strict=True)
    ]
    assert_same(joined, whole)


def test_eval_split_is_disjoint_from_train(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture, "data.eval_fraction=0.2")
    pipeline = Pipeline(cfg)
    source = pipeline.sources[1]
    train, held = pipeline.split(source, "train"), pipeline.split(source, "eval")
    assert not set(train.indices) & set(held.indices)
    assert sorted([*train.indices, *held.indices]) == list(range(source.documents))
    assert 0.1 < len(held) / source.documents < 0.3
    # The eval batches hold only held-out documents' tokens, train batches never do.
    held_tokens = {int(t) for i in held.indices for t in shards.decode_record(held.records[i])}
    held_tokens.discard(EOS)
    eval_batches = take(iter(pipeline.eval()[source.name]), 3)
    eval_ids = {int(t) for b in eval_batches for t in b["inputs"][b["segment_ids"] > 0]} - {EOS}
    assert eval_ids <= held_tokens
    train_ids = {int(t) for b in take(pipeline.train_iterator(), 20) for t in b["inputs"].ravel()}
    assert not train_ids & held_tokens
    # The split is a function of (name, index) only.
    np.testing.assert_array_equal(held_out("medium", 300, 0.2), held_out("medium", 300, 0.2))
    assert not np.array_equal(held_out("medium", 300, 0.2), held_out("other", 300, 0.2))


# ---- the train loop's entry points ------------------------------------------------------------


def test_train_loop_evaluates_each_source_and_their_weighted_mean(make_cfg, tmp_path):
    rng = np.random.default_rng(0)
    specs = []
    for name, weight, length in [("web", 0.75, 30), ("code", 0.25, 90)]:
        docs = [list(rng.integers(2, 256, size=length)) for _ in range(60)]
        specs.append((name, write_source(tmp_path / name, docs, vocab_size=256), weight))
    cfg = make_cfg(
        "data.kind=grain",
        sources_override(specs),
        "data.eval_fraction=0.2",
        "train.eval_every=4",
        "train.eval_steps=2",
    )
    summary = run(cfg)
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    ev = next(x for x in lines if "eval/loss" in x)
    assert ev["step"] == 4 and summary["eval/loss"] == ev["eval/loss"]
    mean = 0.75 * ev["eval/web/loss"] + 0.25 * ev["eval/code/loss"]
    assert ev["eval/loss"] == pytest.approx(mean)
    assert 4.0 < ev["eval/loss"] < 7.0  # ~log(256) for a barely trained model


def test_data_streams_start_step_continues_the_same_stream(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture, "train.eval_every=0")
    train, evals = data_streams(cfg)
    assert evals == []
    expected = take(train, 4)[3]
    later, _ = data_streams(cfg, start_step=3)
    assert_same([next(later)], [expected])


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ((0.5, -0.1), r"'data\.sources\[1\]\.weight' must be >= 0 \(got -0\.1\)"),
        ((0.0, 0.0), r"data\.sources: the weights sum to 0"),
    ],
)
def test_bad_weights_are_config_errors_naming_the_key(make_cfg, tmp_path, weights, message):
    specs = [("a", tmp_path, weights[0]), ("b", tmp_path, weights[1])]
    with pytest.raises(ConfigError, match=message):
        grain_cfg(make_cfg, specs)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.sources=[]", "data.sources is empty"),
        ("data.sources=[{name: a, path: x}, {name: a, path: y}]", "duplicate source name 'a'"),
    ],
)
def test_bad_source_lists_are_config_errors(make_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg("data.kind=grain", override)


def test_missing_source_path_is_a_data_error_naming_source_and_path(make_cfg, tmp_path):
    cfg = grain_cfg(make_cfg, [("web", tmp_path / "nope" / "*.arrayrecord", 1.0)])
    with pytest.raises(DataError, match=r"data\.sources\[web\]: no \.arrayrecord shards match"):
        Pipeline(cfg)


def test_eval_without_held_out_documents_is_a_data_error(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture, "data.eval_fraction=0", "train.eval_every=10")
    with pytest.raises(DataError, match=r"data\.eval_fraction is 0"):
        data_streams(cfg)


def test_model_vocab_smaller_than_the_tokenizer_is_a_data_error(make_cfg, mixture):
    cfg = grain_cfg(make_cfg, mixture, "model.vocab_size=256")
    with pytest.raises(DataError, match=r"data\.sources\[short\]: tokenizer test has a vocab"):
        Pipeline(cfg)


def test_a_shared_embedded_corpus_built_by_another_checkout_names_this_ones_tokenizer(
    make_cfg, tmp_path, monkeypatch
):
    """~/.cache/maxtrain is shared by every checkout, and the corpus records the tokenizer
    path of the one that built it. A refusal names this checkout's tokenizer (the cache key
    is its content's hash, so the two are the same file), not a path that may be gone."""
    import json as json_lib
    import shutil

    from maxtrain.data.corpora.embedded import ensure_embedded_corpus
    from maxtrain.data.grain_pipeline import resolve_sources
    from maxtrain.tokenizers import DEFAULT_TOKENIZER

    built = ensure_embedded_corpus()["prose"].parent
    shared = tmp_path / "cache" / built.name
    shutil.copytree(built, shared)
    for metadata in shared.glob("*/metadata.json"):
        record = json_lib.loads(metadata.read_text())
        metadata.write_text(json_lib.dumps({**record, "tokenizer": "/gone/other/default.model"}))
    monkeypatch.setenv("MAXTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = make_cfg("data.kind=grain")  # the tiny model: 256 ids, the corpus 1024
    with pytest.raises(DataError, match=f"tokenizer {DEFAULT_TOKENIZER} has a vocab of 1024"):
        resolve_sources(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
