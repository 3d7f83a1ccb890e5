"""The offline default corpus: prose, code and math built from the Python installation itself.

The default run must train on real text on any fresh machine, with no download. Every Python
installation carries its documentation and its standard library, and arithmetic can be
generated, so the three sources of a web/code/math-style mixture are built from those:

  prose  the reference topics bundled with pydoc (`pydoc_data.topics`), one document per topic,
         plus the module docstrings of the standard-library modules not used as code
  code   standard-library `.py` files (no tests, GUI or generated tables), a fixed pseudo-random
         selection by path hash up to CODE_MAX_BYTES, one document per file
  math   MATH_DOCUMENTS worksheets of seeded arithmetic problems with worked answers (sums,
         differences, place-value multiplication, long division, two-step expressions)

The build is deterministic on one interpreter; other Python versions carry slightly different
text, which is acceptable. It runs automatically on first use and is cached under
$MAXTRAIN_CACHE (default ~/.cache/maxtrain), keyed by BUILDER_VERSION, the Python version and the
tokenizer's hash; bump BUILDER_VERSION whenever the documents change. A lock serialises
concurrent builders, and the finished corpus appears by one atomic rename of a temporary
directory, so a reader never sees half of it.

The committed tokenizer (maxtrain/data/assets/default.model) was trained on these documents:

    python -m maxtrain.data.corpora.embedded dump /tmp/embedded
    python tools/train_tokenizer.py --input '/tmp/embedded/*.jsonl' \\
        --output maxtrain/data/assets/default --vocab-size 1024 --model-type bpe

`python -m maxtrain.data.corpora.embedded stats` builds the corpus (if needed) and prints its size
and
unigram entropy.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import inspect
import io
import json
import os
import pydoc_data.topics
import random
import shutil
import sys
import sysconfig
import tempfile
import time
import tokenize
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from maxtrain.data.shards import read_metadata, read_shard, write_shards
from maxtrain.tokenizers import DEFAULT_TOKENIZER, load_tokenizer
from maxtrain.training import compile_cache

BUILDER_VERSION = 1
SOURCES = ("prose", "code", "math")
CODE_MAX_BYTES = 1_500_000
CODE_MAX_FILE_BYTES = 60_000  # larger files would crowd out the variety
DOCSTRING_MIN_CHARS = 200
MATH_DOCUMENTS = 1200
MATH_PROBLEMS_PER_DOCUMENT = 8
MATH_SEED = 20_241_122
TOKENS_PER_SHARD = 65_536  # a few shards per source, so a split can hold whole shards out
# Standard-library directories that are tests, GUI, demos, vendored tools or generated data.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip"}
    | {"pydoc_data", "encodings", "__phello__", "site-packages", "dist-packages", "__pycache__"}
)


# ---------------------------------------------------------------------------------- documents


def stdlib_files() -> list[tuple[str, str]]:
    """(path relative to the stdlib, source text) of every candidate module, sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-")]
        for name in names:
            if name.endswith(".py") and not name.startswith("test_"):
                path = Path(top, name)
                text = _read_utf8(path)
                if text and text.strip():  # empty __init__.py files are no documents
                    files.append((path.relative_to(root).as_posix(), text))
    return sorted(files)


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # an installation quirk; the corpus is defined by what is readable


def code_selection(files: list[tuple[str, str]]) -> set[str]:
    """Paths of the code source: files in path-hash order until CODE_MAX_BYTES are taken."""
    by_hash = sorted(files, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())
    chosen, total = set(), 0
    for rel, text in by_hash:
        size = len(text.encode())
        if size > CODE_MAX_FILE_BYTES or total + size > CODE_MAX_BYTES:
            continue
        chosen.add(rel)
        total += size
    return chosen


def module_docstring(source: str) -> str | None:
    """The module docstring, read from the first tokens (far cheaper than parsing the file)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in skip:
                continue
            if token.type != tokenize.STRING:
                return None
            value = ast.literal_eval(token.string)
            return inspect.cleandoc(value) if isinstance(value, str) else None
    except (tokenize.TokenError, SyntaxError, ValueError):
        return None
    return None


def prose_documents(files: list[tuple[str, str]], code: set[str]) -> list[str]:
    topics = pydoc_data.topics.topics
    docs = [topics[name] for name in sorted(topics)]
    for rel, text in files:
        doc = module_docstring(text) if rel not in code else None
        if doc and len(doc) >= DOCSTRING_MIN_CHARS:
            docs.append(doc)
    return docs


def code_documents(files: list[tuple[str, str]], code: set[str]) -> list[str]:
    return [text for rel, text in files if rel in code]


def _sum(rng: random.Random) -> str:
    a, b = rng.randint(10, 9999), rng.randint(10, 9999)
    return f"Q: What is {a} + {b}?\nA: {a} + {b} = {a + b}."


def _difference(rng: random.Random) -> str:
    a, b = sorted((rng.randint(10, 9999), rng.randint(10, 9999)), reverse=True)
    return f"Q: What is {a} - {b}?\nA: {a} - {b} = {a - b}."


def _product(rng: random.Random) -> str:
    """Place-value multiplication: a * 306 = a * 300 + a * 6 = ... ."""
    a, b = rng.randint(12, 999), rng.randint(12, 999)
    digits = str(b)
    parts = [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits) if d != "0"]
    steps = [f"{a} * {b}"]
    if len(parts) > 1:
        steps.append(" + ".join(f"{a} * {p}" for p in parts))
        steps.append(" + ".join(str(a * p) for p in parts))
    steps.append(str(a * b))
    return f"Q: What is {a} * {b}?\nA: " + " = ".join(steps) + "."


def _long_division(rng: random.Random) -> str:
    """Schoolbook long division: one line per digit brought down."""
    divisor = rng.randint(2, 99)
    dividend = rng.randint(divisor * 10, 99_999)
    digits = str(dividend)
    head = next(i for i in range(1, len(digits) + 1) if int(digits[:i]) >= divisor)
    current = int(digits[:head])
    lines = [f"{current} / {divisor} = {current // divisor}, remainder {current % divisor}."]
    for digit in digits[head:]:
        current = current % divisor * 10 + int(digit)
        q, r = divmod(current, divisor)
        lines.append(f"Bring down {digit}: {current} / {divisor} = {q}, remainder {r}.")
    q, r = divmod(dividend, divisor)
    answer = f"{q} remainder {r}" if r else str(q)
    lines.append(f"So {dividend} / {divisor} = {answer}.")
    return f"Q: What is {dividend} / {divisor}?\nA: " + "\n".join(lines)


def _two_step(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 19)
    s = a + b
    return (
        f"Q: What is ({a} + {b}) * {c}?\n"
        f"A: {a} + {b} = {s}. {s} * {c} = {s * c}. So ({a} + {b}) * {c} = {s * c}."
    )


_PROBLEMS: tuple[Callable[[random.Random], str], ...] = (
    _sum,
    _difference,
    _product,
    _long_division,
    _two_step,
)


def math_documents() -> list[str]:
    """Worksheets of problems, blank-line separated."""
    rng = random.Random(MATH_SEED)
    return [
        "\n\n".join(rng.choice(_PROBLEMS)(rng) for _ in range(MATH_PROBLEMS_PER_DOCUMENT))
        for _ in range(MATH_DOCUMENTS)
    ]


def embedded_documents() -> dict[str, list[str]]:
    """{source: documents}, deterministic on one interpreter."""
    files = stdlib_files()
    code = code_selection(files)
    return {
        "prose": prose_documents(files, code),
        "code": code_documents(files, code),
        "math": math_documents(),
    }


# -------------------------------------------------------------------------------------- cache


def cache_key(tokenizer_sha256: str) -> str:
    text = f"{BUILDER_VERSION}|{sys.implementation.name}|{sys.version}|{tokenizer_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_embedded_corpus(
    cache_dir: str | Path | None = None, tokenizer_path: str | Path = DEFAULT_TOKENIZER
) -> dict[str, Path]:
    """{source: prepared-source dir} of the embedded corpus, built into the cache on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else compile_cache.root()
    tokenizer = load_tokenizer(tokenizer_path)
    final = cache_dir / f"embedded-v{BUILDER_VERSION}-{cache_key(tokenizer.sha256)}"
    dirs = {source: final / source for source in SOURCES}
    if _complete(dirs):
        return dirs
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(final.with_name(final.name + ".lock")):
        if _complete(dirs):  # another process built it while this one waited
            return dirs
        shutil.rmtree(final, ignore_errors=True)  # only a hand-damaged corpus gets here
        print(f"maxtrain: building the embedded corpus in {final} (first use)", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            for source, docs in embedded_documents().items():
                write_shards(
                    docs,
                    tokenizer,
                    tmp / source,
                    docs_per_shard=len(docs),
                    tokens_per_shard=TOKENS_PER_SHARD,
                    inputs=[f"embedded:{source}"],
                )
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dirs


def _complete(dirs: dict[str, Path]) -> bool:
    return all((d / "metadata.json").is_file() for d in dirs.values())


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -------------------------------------------------------------------------------- statistics


def unigram_entropy(source_dirs: Sequence[Path], weights: Sequence[float] | None = None) -> float:
    """Entropy (nats/token) of the unigram distribution of prepared sources, EOS included.

    Without weights the sources' tokens are pooled; with weights it is the entropy of the
    weighted mixture of their unigram distributions, which is what a weighted pipeline draws.
    A model that learns nothing beyond token frequencies has this as its loss.
    """
    vocab = max(read_metadata(d)["vocab_size"] for d in source_dirs)
    counts = np.stack([_token_counts(Path(d), vocab) for d in source_dirs])  # [sources, vocab]
    if weights is None:
        p = counts.sum(0) / counts.sum()
    else:
        w = np.asarray(weights, np.float64) / np.sum(weights)
        p = (w[:, None] * counts / counts.sum(1, keepdims=True)).sum(0)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _token_counts(source_dir: Path, vocab: int) -> np.ndarray:
    metadata = read_metadata(source_dir)
    counts = np.zeros(vocab, np.int64)
    for shard in metadata["shards"]:
        counts += np.bincount(
            np.concatenate(read_shard(source_dir / shard["file"])), minlength=vocab
        )
    return counts


def _dump(out_dir: Path) -> None:
    """Writes <source>.jsonl (field "text") per source: the tokenizer's training input."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for source, docs in embedded_documents().items():
        with (out_dir / f"{source}.jsonl").open("w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)


def _stats() -> None:
    start = time.perf_counter()
    dirs = ensure_embedded_corpus()
    print(f"corpus: {dirs['prose'].parent} (ready in {time.perf_counter() - start:.1f} s)")
    for source, d in dirs.items():
        m = read_metadata(d)
        size = f"{m['documents']:,} documents, {m['tokens']:,} tokens, {len(m['shards'])} shards"
        print(f"{source}: {size}")
    print(f"unigram entropy (pooled): {unigram_entropy(list(dirs.values())):.3f} nats/token")


if __name__ == "__main__":
    usage = "usage: python -m maxtrain.data.corpora.embedded dump DIR | stats"
    match sys.argv[1:]:
        case ["dump", out]:
            _dump(Path(out))
        case ["stats"]:
            _stats()
        case _:
            sys.exit(usage)
