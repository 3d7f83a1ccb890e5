"""Data preparation: readers, shards, the two tools and the embedded default corpus.

Everything runs on real files in tmp_path with the committed tokenizer; no jax is needed.
"""

import json
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from support.data import load_tool, prepared

from maxtrain.config import REPO_ROOT
from maxtrain.data.corpora import embedded
from maxtrain.data.errors import DataError
from maxtrain.data.readers import DocumentReader
from maxtrain.data.shards import (
    check_vocab,
    read_metadata,
    read_shard,
    validate_source,
    write_shards,
)
from maxtrain.tokenizers import load_tokenizer

TOKENIZER = embedded.DEFAULT_TOKENIZER
CODE = 'def f(x):\n    """Doc."""\n\treturn  {"a": [x, \'é\', "🙂"]}\n\n\n'


def write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def mixed_jsonl(path: Path) -> Path:
    """3 good documents and one record of each skip reason."""
    return write_jsonl(
        path,
        [
            json.dumps({"text": "first document"}).encode(),
            b"{not json",
            json.dumps({"body": "no text field"}).encode(),
            json.dumps({"text": 7}).encode(),
            b'{"text": "bad \xff byte"}',
            b"",
            json.dumps({"text": "  \n"}).encode(),
            json.dumps({"text": CODE}).encode(),
            json.dumps({"text": "third document"}).encode(),
            b'{"text": "\\ud800"}',
        ],
    )


def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / tool), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---------------------------------------------------------------------------------- readers


def test_jsonl_reader_counts_every_skip_by_reason(tmp_path):
    reader = DocumentReader([str(mixed_jsonl(tmp_path / "a.jsonl"))])
    assert list(reader) == ["first document", CODE, "third document"]
    assert reader.skipped == {
        "invalid-json": 1,
        "missing-field": 1,
        "non-string-field": 1,
        "non-utf8": 2,
        "blank-line": 1,
        "empty-text": 1,
    }
    at = lambda *lines: [f"{tmp_path / 'a.jsonl'}:{n}" for n in lines]  # mixed_jsonl's order
    assert reader.skipped.where == {
        "invalid-json": at(2),
        "missing-field": at(3),
        "non-string-field": at(4),
        "non-utf8": at(5, 10),
        "blank-line": at(6),
        "empty-text": at(7),
    }


def test_jsonl_reader_field_is_configurable(tmp_path):
    path = write_jsonl(tmp_path / "b.json", [json.dumps({"body": "x", "text": "y"}).encode()])
    assert list(DocumentReader([str(path)], field="body")) == ["x"]


def test_txt_reader_per_file_and_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nline two\n\n \n\npara two\r\n\r\npara three\n")
    (tmp_path / "b.txt").write_bytes(b"latin-1 \xe9t\xe9\n")
    (tmp_path / "c.txt").write_text("\n\n")
    whole = DocumentReader([str(tmp_path / "*.txt")])
    assert list(whole) == ["para one\nline two\n\n \n\npara two\r\n\r\npara three\n"]
    assert whole.skipped == {"non-utf8": 1, "empty-text": 1}
    paragraphs = DocumentReader([str(tmp_path / "a.txt")], txt_split="paragraph")
    assert list(paragraphs) == ["para one\nline two", "para two", "para three"]


def test_parquet_reader_goes_row_group_by_row_group(tmp_path):
    table = pa.table({"content": ["a", None, "b", "", "c"], "n": [1, 2, 3, 4, 5]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    assert pq.ParquetFile(tmp_path / "d.parquet").num_row_groups == 3
    reader = DocumentReader([str(tmp_path / "d.parquet")], field="content")
    assert list(reader) == ["a", "b", "c"]
    assert reader.skipped == {"missing-field": 1, "empty-text": 1}
    with pytest.raises(DataError, match="has no column 'text'"):
        list(DocumentReader([str(tmp_path / "d.parquet")]))
    with pytest.raises(DataError, match="column 'n' .* has type int64"):
        list(DocumentReader([str(tmp_path / "d.parquet")], field="n"))


def test_reader_errors_name_the_pattern_or_file(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"no files match '{tmp_path}/*.jsonl'")):
        DocumentReader([str(tmp_path / "*.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="cannot tell the format of .*x.csv"):
        DocumentReader([str(tmp_path / "x.csv")])
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="cannot read .*bad.parquet"):
        list(DocumentReader([str(tmp_path / "bad.parquet")]))


# ----------------------------------------------------------------------------------- shards


def test_prepare_data_cli_end_to_end(tmp_path):
    mixed_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "b.txt").write_text("One paragraph.\n\nAnother one, ünïcödé.\n")
    out = tmp_path / "out"
    result = run_tool(
        "prepare_data.py",
        "--input", tmp_path / "*.jsonl", tmp_path / "*.txt",
        "--tokenizer", TOKENIZER,
        "--output", out,
        "--docs-per-shard", "2",
        "--txt-split", "paragraph",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "5 documents" in result.stdout and "3 shards" in result.stdout
    assert f"invalid-json 1 ({tmp_path / 'a.jsonl'}:2)" in result.stdout
    assert f"non-utf8 2 ({tmp_path / 'a.jsonl'}:5, {tmp_path / 'a.jsonl'}:10)" in result.stdout

    info = validate_source(out / "*.arrayrecord")
    metadata = read_metadata(out)
    docs = [d for shard in info.shards for d in read_shard(shard)]
    tokenizer = load_tokenizer(TOKENIZER)
    assert metadata["documents"] == info.documents == len(docs) == 5
    assert metadata["tokens"] == info.tokens == sum(len(d) for d in docs)
    assert [s["tokens"] for s in metadata["shards"]] == [
        sum(len(d) for d in read_shard(out / s["file"])) for s in metadata["shards"]
    ]
    assert all(d.dtype == np.dtype("<i4") and d[-1] == metadata["eos_id"] for d in docs)
    texts = [tokenizer.decode(d[:-1]) for d in docs]
    jsonl_docs = ["first document", CODE, "third document"]
    assert texts == [*jsonl_docs, "One paragraph.", "Another one, ünïcödé."]
    assert metadata["skipped"]["invalid-json"] == 1
    assert metadata["vocab_size"] == 1024 and metadata["tokenizer"] == str(TOKENIZER)
    assert metadata["inputs"] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]


def test_prepare_data_cli_errors_are_one_line_and_leave_nothing(tmp_path):
    out = tmp_path / "new" / "out"
    result = run_tool("prepare_data.py", "--input", tmp_path / "*.jsonl", "--tokenizer",
                      TOKENIZER, "--output", out)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == f"prepare_data: error: no files match '{tmp_path}/*.jsonl'\n"
    assert not (tmp_path / "new").exists()

    mixed_jsonl(tmp_path / "a.jsonl")
    result = run_tool("prepare_data.py", "--input", tmp_path / "a.jsonl", "--tokenizer",
                      tmp_path / "missing.model", "--output", out)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == f"prepare_data: error: tokenizer not found: {tmp_path}/missing.model\n"
    assert not (tmp_path / "new").exists()


def test_prepare_refuses_to_overwrite_a_prepared_source(tmp_path, capsys):
    prepare_data = load_tool("prepare_data")
    mixed_jsonl(tmp_path / "a.jsonl")
    args = ["--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(TOKENIZER)]
    args += ["--output", str(tmp_path / "out")]
    assert prepare_data.main(args) == 0
    first = read_metadata(tmp_path / "out")
    assert prepare_data.main(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("prepare_data: error:") and "--overwrite" in err
    assert prepare_data.main([*args, "--overwrite", "--docs-per-shard", "1"]) == 0
    assert read_metadata(tmp_path / "out")["documents"] == first["documents"]
    assert len(list((tmp_path / "out").glob("*.arrayrecord"))) == first["documents"]


def test_failed_write_leaves_no_shards_and_no_new_directory(tmp_path):
    def docs():
        yield from ["a"] * 600  # more than one encode batch, so shards exist when it fails
        raise DataError("cannot read x.jsonl")

    out = tmp_path / "new" / "out"
    with pytest.raises(DataError, match="x.jsonl"):
        write_shards(docs(), load_tokenizer(TOKENIZER), out, docs_per_shard=100)
    assert not (tmp_path / "new").exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "README").write_text("keep me")
    with pytest.raises(DataError):
        write_shards(docs(), load_tokenizer(TOKENIZER), existing, docs_per_shard=100)
    assert [p.name for p in existing.iterdir()] == ["README"]


def test_interrupted_leftover_shards_need_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.arrayrecord").write_bytes(b"left over")
    with pytest.raises(DataError, match="no metadata.json .*--overwrite"):
        prepared(tmp_path, ["doc"], "out")
    prepared(tmp_path, ["doc"], "out", overwrite=True)
    assert validate_source(out).documents == 1


def test_validate_source_names_a_truncated_shard(tmp_path):
    out = prepared(tmp_path, [f"document {i} " * 50 for i in range(40)], docs_per_shard=20)
    shard = out / "shard-00001.arrayrecord"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DataError, match=f"corrupt ArrayRecord file {shard}"):
        validate_source(out)


def test_validate_source_rejects_an_empty_shard_and_missing_metadata(tmp_path):
    out = prepared(tmp_path, ["one", "two"])
    writer = ArrayRecordWriter(str(out / "shard-00001.arrayrecord"), "group_size:1")
    writer.close()
    metadata = read_metadata(out)
    metadata["shards"].append({"file": "shard-00001.arrayrecord", "documents": 0, "tokens": 0})
    (out / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(DataError, match="empty shard .*shard-00001.arrayrecord"):
        validate_source(out)
    (out / "metadata.json").unlink()
    with pytest.raises(DataError, match="has no metadata.json"):
        validate_source(out)
    with pytest.raises(DataError, match="no .arrayrecord shards match"):
        validate_source(tmp_path / "nothing" / "*.arrayrecord")


def test_vocab_check_names_both_sizes(tmp_path):
    metadata = read_metadata(prepared(tmp_path, ["text"]))
    check_vocab(metadata, 1024)
    with pytest.raises(DataError, match="vocab of 1024, larger than the model's vocab_size 512"):
        check_vocab(metadata, 512)


def test_load_tokenizer_rejects_a_file_that_is_not_a_model(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match="bad.model is not a valid sentencepiece model"):
        load_tokenizer(tmp_path / "bad.model")


# -------------------------------------------------------------------------------- tokenizer


def test_train_tokenizer_is_deterministic_and_round_trips(tmp_path, capsys):
    train_tokenizer = load_tool("train_tokenizer")
    topics = embedded.pydoc_data.topics.topics
    docs = embedded.math_documents()[:50] + [topics[k] for k in sorted(topics)[:10]]
    lines = [json.dumps({"text": d}).encode() for d in docs]
    write_jsonl(tmp_path / "m.jsonl", [*lines, json.dumps({"text": CODE}).encode(), b"{bad"])
    for prefix in ("a", "b"):
        args = ["--input", str(tmp_path / "*.jsonl"), "--output", str(tmp_path / prefix)]
        assert train_tokenizer.main([*args, "--vocab-size", "400", "--model-type", "bpe"]) == 0
    assert "invalid-json 1" in capsys.readouterr().out
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    tokenizer = load_tokenizer(tmp_path / "a.model")
    assert tokenizer.vocab_size == 400 and tokenizer.eos_id == 3
    assert (tmp_path / "a.vocab").read_text().splitlines()[3].startswith("</s>\t")
    for text in (CODE, "Q: What is 12 * 34?\n", "∑ unseen chars 漢字"):
        assert tokenizer.decode(tokenizer.encode([text])[0]) == text

    args = ["--input", str(tmp_path / "m.jsonl"), "--output", str(tmp_path / "c")]
    assert train_tokenizer.main([*args, "--vocab-size", "5000", "--model-type", "unigram"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_tokenizer: error: Vocabulary size")


def test_default_tokenizer_round_trips_code_and_prose():
    tokenizer = load_tokenizer(TOKENIZER)
    assert tokenizer.vocab_size == 1024 and (tokenizer.bos_id, tokenizer.eos_id) == (2, 3)
    for text in (CODE, embedded.pydoc_data.topics.topics["if"]):
        assert tokenizer.decode(tokenizer.encode([text])[0]) == text


# --------------------------------------------------------------------------------- embedded


def test_embedded_corpus_builds_once_deterministically(tmp_path):
    first = embedded.ensure_embedded_corpus(tmp_path / "a")
    second = embedded.ensure_embedded_corpus(tmp_path / "b")
    assert set(first) == {"prose", "code", "math"}
    for source in first:
        a, b = read_metadata(first[source]), read_metadata(second[source])
        assert a["shards"] == b["shards"] and a["tokens"] == b["tokens"] > 100_000
        assert validate_source(first[source]).documents == a["documents"]
        doc = read_shard(first[source] / a["shards"][0]["file"])[0]
        assert len(load_tokenizer(TOKENIZER).decode(doc[:-1])) > 100
    built = first["math"].parent
    assert embedded.ensure_embedded_corpus(tmp_path / "a") == first  # cached
    assert [p.name for p in (tmp_path / "a").iterdir() if not p.name.endswith(".lock")] == [
        built.name
    ]

    dirs = list(first.values())
    entropy = embedded.unigram_entropy(dirs)
    assert 3.0 < entropy < math.log(1024)
    only_math = embedded.unigram_entropy(dirs, weights=[0, 0, 1])
    assert only_math == pytest.approx(embedded.unigram_entropy([first["math"]]))


def test_embedded_code_and_prose_do_not_overlap():
    files = embedded.stdlib_files()
    code = embedded.code_selection(files)
    code_docs = embedded.code_documents(files, code)
    prose = embedded.prose_documents(files, code)
    assert sum(len(d.encode()) for d in code_docs) <= embedded.CODE_MAX_BYTES
    assert not any(embedded.module_docstring(d) in prose for d in code_docs)


_DIVISION = re.compile(r"(\d+) / (\d+) = (\d+)(?:,? remainder (\d+))?")


def check_statement(statement: str, remainder: int | None) -> int | None:
    """Checks one worked step; returns the remainder a long division carries to the next step."""
    statement = statement.removeprefix("So ")
    if statement.startswith("Bring down"):
        digit, statement = re.match(r"Bring down (\d): (.+)", statement).groups()
        assert int(statement.split(" / ")[0]) == remainder * 10 + int(digit)
    if "/" in statement:
        a, b, q, r = re.fullmatch(_DIVISION, statement).groups()
        assert (int(q), int(r or 0)) == divmod(int(a), int(b))
        return int(r or 0)
    values = [eval(side) for side in statement.split(" = ")]  # digits, + - * ( ) only
    assert len(values) > 1 and len(set(values)) == 1
    return None


def test_embedded_math_answers_are_right():
    docs = embedded.math_documents()
    assert len(docs) == embedded.MATH_DOCUMENTS
    checked = 0
    for problem in (p for doc in docs[:300] for p in doc.split("\n\n")):
        question, answer = re.fullmatch(r"Q: What is (.+)\?\nA: (.+)\.", problem, re.S).groups()
        assert answer.split(". ")[-1].split("\n")[-1].startswith(("So ", question + " = "))
        remainder = None
        for statement in re.split(r"\.\s", answer):
            try:
                remainder = check_statement(statement, remainder)
            except (AssertionError, AttributeError) as e:
                raise AssertionError(f"{statement!r} in {problem!r}") from e
            checked += 1
    assert checked > 3000


def test_concurrent_embedded_builds_share_one_cache(tmp_path):
    with ThreadPoolExecutor(2) as pool:  # flock excludes separate opens, threads included
        results = list(pool.map(lambda _: embedded.ensure_embedded_corpus(tmp_path), range(2)))
    assert results[0] == results[1]
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [
        results[0]["math"].parent.name
    ]
    for source_dir in results[0].values():
        validate_source(source_dir)
