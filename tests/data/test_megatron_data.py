"""data.kind megatron against Megatron itself: the samples, blends, splits and token handling
megatron-core 0.16.1 produced for the committed corpora (tests/fixtures/megatron, written by
tools/make_megatron_fixtures.py), the format checks, per-host reading and resume, and the
tools.
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import support
from support.data import load_tool
from support.runs import interrupt, logged_step_at_least, losses, run_to_end

from maxtrain import config as config_lib
from maxtrain.checkpointing.data_state import JsonIteratorState, adapter_for
from maxtrain.config import ConfigError
from maxtrain.data import BATCH_KEYS
from maxtrain.data.corpora.embedded import DEFAULT_TOKENIZER
from maxtrain.data.errors import DataError
from maxtrain.data.megatron import gpt_indices
from maxtrain.data.megatron.indexed import DTYPES, IndexedWriter, open_corpus
from maxtrain.data.megatron.stream import GlobalBatches, MegatronData, StepIterator
from maxtrain.data.streams import data_streams
from maxtrain.training.loop import main as train_main

FIXTURES = support.FIXTURES / "megatron"
META = json.loads((FIXTURES / "configs.json").read_text())
EOD = META["eod"]
CODE_VOCAB = 70_000  # the int32 corpus holds ids beyond uint16


def fixture(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "samples" / f"{name}.npz"))


def source_list(sources: list, corpora: Path = FIXTURES / "corpora") -> str:
    listed = [{"name": n, "path": str(corpora / n), "weight": w or 1.0} for n, w in sources]
    return "data.sources=" + json.dumps(listed)


def overrides_for(name: str, cache: Path) -> list[str]:
    """maxtrain keys equal to the fixture config's Megatron settings."""
    c = META["configs"][name]
    names = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
    switches = [f"data.megatron.{s}=true" for s in names if c.get(s)]
    return [
        "data.kind=megatron", source_list(c["sources"]), f"data.megatron.split={c['split']}",
        f"data.megatron.eod_id={EOD}", f"model.vocab_size={CODE_VOCAB}", f"data.cache_dir={cache}",
        f"run.seed={c['seed']}", f"train.seq_len={c['seq_len']}", f"train.steps={c['steps']}",
        f"train.global_batch_size={c['global_batch_size']}", f"train.eval_every={c['eval_every']}",
        f"train.eval_steps={c['eval_steps']}", "model.max_seq_len=128", *switches,
    ]  # fmt: skip


@pytest.fixture
def megatron_cfg(make_cfg, tmp_path):
    def make(name: str, *extra: str) -> config_lib.Config:
        return make_cfg(*overrides_for(name, tmp_path / "cache"), *extra)

    return make


def windows(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The seq_len + 1 tokens of each row: its inputs and its last target."""
    return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


# ---- Megatron's samples, bit for bit ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(META["configs"]))
def test_samples_are_megatrons_for_every_fixture_config(megatron_cfg, name):
    cfg, expected = megatron_cfg(name), fixture(name)
    train = MegatronData(cfg).train()
    np.testing.assert_array_equal(train.windows(expected["sample_ids"]), expected["tokens"])
    assert len(train) == META["configs"][name]["train_samples"]  # Megatron's dataset length
    if "dataset_ids" in expected:  # the blend picked the same source for every sample
        np.testing.assert_array_equal(
            train.source_of(expected["sample_ids"]), expected["dataset_ids"]
        )


@pytest.mark.parametrize("name", ["blend3_s64", "web_s64_multi_epoch"])
def test_global_batch_t_holds_samples_t_times_b_onwards_in_row_order(megatron_cfg, name):
    cfg, expected = megatron_cfg(name), fixture(name)
    batch_size = cfg.train.global_batch_size
    train, _ = data_streams(cfg)
    for step in range(3):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        np.testing.assert_array_equal(windows(next(train)), expected["tokens"][rows])
    train.close()


def test_eval_streams_are_each_sources_valid_split(megatron_cfg):
    cfg, expected = megatron_cfg("blend3_s64"), fixture("blend3_s64")
    _, evals = data_streams(cfg)
    assert [(e.name, e.weight) for e in evals] == [("web", 0.5), ("code", 0.3), ("math", 0.2)]
    for stream in evals:
        valid = expected[f"valid_{stream.name}"]
        batches = stream.batches()
        first = np.concatenate([windows(next(batches)) for _ in range(len(valid) // 8)])
        np.testing.assert_array_equal(first, valid[: len(first)])
        again = windows(next(stream.batches()))  # every eval starts from the same samples
        np.testing.assert_array_equal(again, valid[:8])


def test_split_ranges_are_megatrons():
    for case in META["split_ranges"]:
        ranges = gpt_indices.split_ranges(case["split"], case["sequences"]).values()
        got = [None if r is None else [r.start, r.stop] for r in ranges]
        assert got == case["ranges"], case


# ---- token handling ---------------------------------------------------------------------------


def first_visible_key(segment_ids: np.ndarray) -> np.ndarray:
    """[R, S] -> per query, the first key of its (contiguous) segment: what attention may see."""
    t = np.arange(segment_ids.shape[1])
    starts = np.where(np.diff(segment_ids, axis=1, prepend=-1) != 0, t, 0)
    return np.maximum.accumulate(starts, axis=1)


@pytest.mark.parametrize("name", ["web_s32", "math_s32_switches", "web_math_s32_eod_mask_loss"])
def test_token_switches_give_megatrons_loss_mask_positions_and_attention(megatron_cfg, name):
    data, expected = MegatronData(megatron_cfg(name)), fixture(name)
    train = GlobalBatches(data.train(), range(8), 8, data.handling)
    steps = np.unique(expected["sample_ids"][:64] // 8)
    batch = {k: np.concatenate([train[int(s)][k] for s in steps]) for k in BATCH_KEYS}
    np.testing.assert_array_equal(batch["loss_mask"], expected["loss_mask"][:64])
    np.testing.assert_array_equal(batch["positions"], expected["position_ids"][:64])
    np.testing.assert_array_equal(
        first_visible_key(batch["segment_ids"]), expected["first_key"][:64]
    )
    switched = META["configs"][name]
    assert (batch["loss_mask"] == 0).any() == bool(switched.get("eod_mask_loss"))
    assert (batch["segment_ids"] > 1).any() == bool(switched.get("reset_attention_mask"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.megatron.eod_mask_loss=true", r"eod_mask_loss needs data\.megatron\.eod_id"),
        ("data.megatron.split=99/1", r"'99/1' is not a Megatron --split"),
        ("data.megatron.split=0,0,0", r"'0,0,0' gives every split 0"),
        ("data.sources=[{name: a, path: x, weight: 0}, {name: b, path: y}]", r"\[a\]\.weight is 0"),
    ],
)
def test_megatron_config_mistakes_are_config_errors(make_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg("data.kind=megatron", override)


# ---- per host, resume --------------------------------------------------------------------------


def test_two_hosts_rows_together_are_the_one_host_batch(megatron_cfg):
    data = MegatronData(megatron_cfg("blend2_web_code"))
    samples = data.train()
    whole = GlobalBatches(samples, range(8), 8, data.handling)
    halves = [GlobalBatches(samples, rows, 8, data.handling) for rows in (range(4), range(4, 8))]
    for step in (0, 1, 17):
        for key in BATCH_KEYS:
            joined = np.concatenate([h[step][key] for h in halves])
            np.testing.assert_array_equal(joined, whole[step][key], err_msg=key)


def test_resume_on_another_host_count_continues_the_same_global_order(megatron_cfg):
    data = MegatronData(megatron_cfg("blend2_web_code", "data.worker_buffer_size=2"))
    batches = lambda rows: GlobalBatches(data.train(), rows, 8, data.handling)  # noqa: E731
    one_host = StepIterator(batches(range(8)), 0, num_workers=0, buffer_size=2)
    for _ in range(5):
        next(one_host)
    saved = json.loads(json.dumps(one_host.get_state()))  # what the checkpoint holds
    assert saved == {"step": 5} and isinstance(adapter_for(one_host), JsonIteratorState)
    expected = [next(one_host) for _ in range(3)]
    hosts = [StepIterator(batches(rows), 0, 0, 2) for rows in (range(4), range(4, 8))]
    for host in hosts:
        host.set_state(saved)
    for want in expected:
        got = [next(host) for host in hosts]
        np.testing.assert_array_equal(np.concatenate([g["inputs"] for g in got]), want["inputs"])
    for it in (one_host, *hosts):
        it.close()


# ---- the format's checks ----------------------------------------------------------------------


def copy_corpus(tmp_path: Path, name: str = "web") -> Path:
    for suffix in (".bin", ".idx"):
        shutil.copy(FIXTURES / "corpora" / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    return tmp_path / name


def patch_idx(prefix: Path, offset: int, data: bytes) -> None:
    raw = bytearray(prefix.with_suffix(".idx").read_bytes())
    raw[offset : offset + len(data)] = data
    prefix.with_suffix(".idx").write_bytes(bytes(raw))


def truncate_bin(prefix: Path) -> None:
    prefix.with_suffix(".bin").write_bytes(prefix.with_suffix(".bin").read_bytes()[:-2])


CORRUPTIONS = {  # name: (damage, the message's regex)
    "missing .bin": (lambda p: p.with_suffix(".bin").unlink(), r"web\.bin not found: web\.idx"),
    "missing .idx": (lambda p: p.with_suffix(".idx").unlink(), r"web\.idx not found"),
    "wrong magic": (lambda p: patch_idx(p, 0, b"NOTMEGA"), r"web\.idx is not a Megatron index"),
    "wrong version": (lambda p: patch_idx(p, 9, struct.pack("<Q", 2)), r"index version 2"),
    "unknown dtype": (lambda p: patch_idx(p, 17, b"\x09"), r"web\.idx has token dtype code 9"),
    "counts vs .idx size": (
        lambda p: patch_idx(p, 18, struct.pack("<Q", 111)),
        r"web\.idx is \d+ bytes, but its header's 111 sequences",
    ),
    "counts vs .bin size": (truncate_bin, r"web\.bin is \d+ bytes, but web\.idx places"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_damaged_corpus_is_a_data_error_naming_the_file(tmp_path, corruption):
    prefix = copy_corpus(tmp_path)
    damage, message = CORRUPTIONS[corruption]
    damage(prefix)
    with pytest.raises(DataError, match=message):
        open_corpus(prefix)


def test_token_ids_beyond_the_vocab_and_missing_eods_are_data_errors(megatron_cfg):
    too_large = r"data\.sources\[code\]: .*code\.bin holds token id \d+, outside .* \[0, 256\)"
    with pytest.raises(DataError, match=too_large):
        MegatronData(megatron_cfg("code_s48_int32", "model.vocab_size=256"))
    no_eod = (
        r"none of 110 documents checked ends in the end-of-document id 7 .*\.eod_mask_loss relies"
    )
    with pytest.raises(DataError, match=no_eod):
        MegatronData(
            megatron_cfg("web_s32", "data.megatron.eod_id=7", "data.megatron.eod_mask_loss=true")
        )


def test_the_cli_refuses_a_half_pair_and_a_too_large_id_in_one_line_with_exit_2(tmp_path, capsys):
    """The train command's main, in this process (a refusal needs no interpreter of its own;
    tests/training/test_bad_inputs.py shows exit 2 and one line at the process boundary)."""
    for name in ("half", "whole"):
        (tmp_path / name).mkdir()
        copy_corpus(tmp_path / name, "code")
    (tmp_path / "half" / "code.idx").unlink()
    base = [str(config_lib.CONFIGS_DIR / "base.yml"), "model_name=tiny",
            f"run.output_dir={tmp_path}", "data.kind=megatron"]  # fmt: skip
    runs = {
        "code.idx not found": ["run.name=run1", source_list([["code", 1.0]], tmp_path / "half")],
        "holds token id": ["run.name=run2", source_list([["code", 1.0]], tmp_path / "whole"),
                           f"data.cache_dir={tmp_path / 'cache'}"],
    }  # fmt: skip
    for words, overrides in runs.items():
        capsys.readouterr()
        status = train_main([*base, *overrides])
        stderr = capsys.readouterr().err
        assert status == 2, stderr[-2000:]
        assert stderr.startswith("maxtrain: error: data.sources[code]: ")
        assert words in stderr and stderr.count("\n") == 1
    assert not (tmp_path / "run1").exists() and not (tmp_path / "run2").exists()  # nothing written


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_every_megatron_dtype_round_trips_through_the_writer_and_reader(tmp_path, code):
    dtype = DTYPES[code]
    docs = [np.array([5, 6, 7]), np.array([100]), np.array([], int), np.arange(20, 60)]
    writer = IndexedWriter(tmp_path / "c", dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finish()
    corpus = open_corpus(tmp_path / "c")
    assert corpus.tokens.dtype == dtype and corpus.num_sequences == 4
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(corpus.sequence(i), doc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]  # no temporaries


# ---- the tools ----------------------------------------------------------------------------------


def test_prepare_data_writes_what_megatron_read_back(tmp_path):
    prepared = FIXTURES / "prepared"
    prefix = tmp_path / "new" / "corpus"  # its directory is created, as for ArrayRecord output
    argv = ["--input", str(prepared / "input.jsonl"), "--output", str(prefix),
            "--tokenizer", str(config_lib.REPO_ROOT / "maxtrain/data/assets/default.model"),
            "--output-format", "megatron"]  # fmt: skip
    assert load_tool("prepare_data").main(argv) == 0
    for suffix in (".bin", ".idx"):  # byte for byte the pair Megatron's IndexedDataset read
        assert (prefix.with_suffix(suffix)).read_bytes() == (
            prepared / f"corpus{suffix}"
        ).read_bytes()
    megatron = np.load(prepared / "megatron_read.npz")
    corpus = open_corpus(prefix)
    assert corpus.tokens.dtype.name == str(megatron["dtype"])
    np.testing.assert_array_equal(corpus.sequence_lengths, megatron["lengths"])
    np.testing.assert_array_equal(corpus.tokens, megatron["tokens"])
    assert load_tool("prepare_data").main(argv) == 2  # an existing pair is never overwritten


def test_a_split_too_small_for_evaluation_is_refused_alike_by_training_and_show_data(
    tmp_path, capsys
):
    """9 documents under Megatron's default split 969,30,1: no valid sequences. The trainer
    and show_data check the same config the same way, in one line saying what to change."""
    base = str(config_lib.CONFIGS_DIR / "base.yml")
    args = [base, "model_name=tiny", "model.vocab_size=1024", "data.kind=megatron",
            f"data.sources=[{{name: small, path: {FIXTURES / 'prepared' / 'corpus'}}}]",
            f"data.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path}",
            "train.eval_every=2"]  # fmt: skip
    said = []
    for program, argv in (
        (train_main, args),
        (load_tool("show_data").main, [*args, "--steps", "1", "--out", str(tmp_path / "b.npz")]),
    ):
        assert program(argv) == 2
        said.append(capsys.readouterr().err.split(": error: ", 1)[1])
    assert (
        said[0]
        == said[1]
        == (
            "data.sources[small]: data.megatron.split '969,30,1' leaves the valid split of its 9 "
            "sequences no tokens; give that split a larger share or set train.eval_every=0 (no "
            "evaluation)\n"
        )
    )
    assert load_tool("show_data").main([*args, "train.eval_every=0", "--steps", "1", "--out",
                                        str(tmp_path / "b.npz")]) == 0  # fmt: skip


def test_show_data_writes_the_global_batches_for_megatron_and_grain_configs(tmp_path):
    show_data = load_tool("show_data")
    out = tmp_path / "megatron.npz"
    base = str(config_lib.CONFIGS_DIR / "base.yml")
    args = [base, *overrides_for("blend3_s64", tmp_path / "cache"), "model_name=tiny"]
    assert show_data.main([*args, "--steps", "4", "--out", str(out)]) == 0
    shown, expected = np.load(out), fixture("blend3_s64")
    assert shown["inputs"].shape == (4, 8, 64)
    full = np.concatenate([shown["inputs"], shown["targets"][..., -1:]], axis=2).reshape(32, 65)
    np.testing.assert_array_equal(full, expected["tokens"][:32])
    grain_out = tmp_path / "grain.npz"
    grain_args = [base, "model_name=tiny", "model.vocab_size=1024", "train.global_batch_size=4"]
    assert show_data.main([*grain_args, "--steps", "2", "--out", str(grain_out)]) == 0
    shown = np.load(grain_out)
    assert sorted(shown.files) == sorted(BATCH_KEYS) and shown["inputs"].shape == (2, 4, 128)
    assert (shown["segment_ids"] > 1).any()  # packed documents, as the train loop gets them
    # And as text: the embedded corpus's tokenizer decodes each document of each row.
    text = grain_out.with_suffix(".txt").read_text()
    sp = spm.SentencePieceProcessor(model_file=str(DEFAULT_TOKENIZER))
    ids, segments = shown["inputs"][0, 0], shown["segment_ids"][0, 0]
    first = sp.decode(ids[segments == segments[0]].tolist())
    assert text.startswith(f"=== step 1 row 0\n[{segments[0]}] {first}\n")
    assert not out.with_suffix(".txt").exists()  # a Megatron corpus names no tokenizer


# ---- a real run ---------------------------------------------------------------------------------


def past_a_checkpoint(run_dir: Path) -> bool:
    """A checkpoint is committed and the run has logged two steps after it (to be replayed)."""
    local = run_dir / "checkpoints" / "local"
    saved = [int(p.name) for p in local.iterdir() if p.name.isdigit()] if local.is_dir() else []
    return bool(saved) and logged_step_at_least(min(saved) + 2)(run_dir)


def test_training_on_a_megatron_blend_resumes_bit_exactly_after_sigkill(tmp_path):
    """The killed run is an uninterrupted run up to the kill: the resumed run must replay the
    steps after its checkpoint with bit-identical losses (one run less than test_resume's)."""
    args = [
        "model_name=tiny", "data.kind=megatron", source_list([["web", 0.6], ["math", 0.4]]),
        "data.megatron.split=90,10,0", f"data.megatron.eod_id={EOD}",
        "data.megatron.reset_position_ids=true", "data.megatron.reset_attention_mask=true",
        "data.megatron.eod_mask_loss=true", f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=10", "train.seq_len=32", "train.global_batch_size=8", "train.log_every=1",
        "train.eval_every=10", "train.eval_steps=1", "checkpoint.local.every_steps=3",
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    killed = interrupt(run_dir, past_a_checkpoint, signal.SIGKILL, args)
    assert killed.returncode == -signal.SIGKILL
    uninterrupted = losses(run_dir)
    resumed_at = int(run_to_end(run_dir, args).stdout.split("resumed at step ")[1].split()[0])
    replayed = [step for step in uninterrupted if step > resumed_at]
    assert len(replayed) >= 2, (resumed_at, uninterrupted)
    after = losses(run_dir)  # the resumed run's lines win for the steps it ran
    assert sorted(after) == list(range(1, 11))
    assert {s: after[s] for s in replayed} == {s: uninterrupted[s] for s in replayed}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [x for x in lines if "eval/loss" in x][-1]
    assert {"eval/web/loss", "eval/math/loss"} <= set(last_eval) and last_eval["step"] == 10
