"""Writes the committed evaluation tasks (maxtrain/evaluation/tasks/) from the embedded corpus.

    python tools/make_eval_tasks.py [--output maxtrain/evaluation/tasks]

Each task is a directory with test.jsonl (scored) and train.jsonl (n-shot examples), one
example per line in the lm-evaluation-harness style: {"context", "choices", "gold"} for a
multiple-choice task, {"context", "continuation"} for a completion task. The test examples
come from the documents the training run holds out (data.eval_fraction 0.05 of each source,
maxtrain/data/grain_pipeline.py held_out), the train examples from the others, so a model is scored
on text it never trained on:

  prose_continuation  which of 4 eight-word continuations of a documentation passage is the
                      real one; the others hold the same words in shuffled orders, so only a
                      model that learned how words follow each other tells them apart (a
                      unigram model cannot); chance 1/4
  code_next_line      which of 4 lines is the next line of a standard-library file; the others
                      are its words (split at spaces, indentation kept) shuffled; chance 1/4
  arithmetic          the result of a sum or difference (completion: greedy exact match and
                      log-likelihood of the answer)

Deterministic for one Python installation (the corpus is the standard library it carries).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from maxtrain.data.corpora.embedded import embedded_documents
from maxtrain.data.grain_pipeline import held_out

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "evaluation" / "tasks"
EVAL_FRACTION = 0.05  # data.eval_fraction's default (configs/reference.yml)
SEED = 26
CHOICES = 4
CONTEXT_WORDS, CONTINUATION_WORDS = 24, 8
CONTEXT_LINES = 6
LIMITS = {"test": 200, "train": 200}  # examples per split


def split_documents(name: str, documents: list[str]) -> dict[str, list[str]]:
    mask = held_out(name, len(documents), EVAL_FRACTION)
    return {
        "test": [d for d, h in zip(documents, mask, strict=True) if h],
        "train": [d for d, h in zip(documents, mask, strict=True) if not h],
    }


def prose_continuation(documents: list[str], rng: random.Random) -> list[dict]:
    """Passages of CONTEXT + CONTINUATION words inside a paragraph; distractors are the
    continuation spans of other passages."""
    passages = []
    for doc in documents:
        for paragraph in re.split(r"\n\s*\n", doc):
            words = paragraph.split()
            for start in range(0, len(words) - CONTEXT_WORDS - CONTINUATION_WORDS + 1, 6):
                middle = start + CONTEXT_WORDS
                passages.append(
                    (
                        " ".join(words[start:middle]),
                        " " + " ".join(words[middle : middle + CONTINUATION_WORDS]),
                    )
                )
    return _multiple_choice(passages, rng)


def code_next_line(documents: list[str], rng: random.Random) -> list[dict]:
    """CONTEXT_LINES lines of a file and its next non-blank line; distractors are other files'
    next lines."""
    passages = []
    for doc in documents:
        lines = doc.split("\n")
        for end in range(CONTEXT_LINES, len(lines), 1):
            nxt = lines[end]
            if nxt.strip() and len(nxt) < 100:
                passages.append(("\n".join(lines[end - CONTEXT_LINES : end]) + "\n", nxt))
    return _multiple_choice(passages, rng)


def _multiple_choice(passages: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    """Each passage's real continuation against CHOICES - 1 different shufflings of its words
    (passages with too few distinct orders are skipped)."""
    rng.shuffle(passages)
    examples = []
    for context, real in passages:
        indent = real[: len(real) - len(real.lstrip())]
        words = real.split()
        if indent + " ".join(words) != real:  # spacing inside would tell the real one apart
            continue
        orders = {real}
        for _ in range(20 * CHOICES):
            rng.shuffle(words)
            orders.add(indent + " ".join(words))
            if len(orders) == CHOICES:
                break
        if len(orders) < CHOICES:
            continue
        choices = sorted(orders)
        rng.shuffle(choices)
        examples.append({"context": context, "choices": choices, "gold": choices.index(real)})
    return examples


def arithmetic(documents: list[str], rng: random.Random) -> list[dict]:
    problems = [
        m.groups()
        for doc in documents
        for m in re.finditer(r"(Q: What is \d+ [+-] \d+\?\nA: \d+ [+-] \d+ =)( \d+\.)", doc)
    ]
    rng.shuffle(problems)
    return [{"context": c, "continuation": a} for c, a in problems]


TASKS = {
    "prose_continuation": ("prose", prose_continuation),
    "code_next_line": ("code", code_next_line),
    "arithmetic": ("math", arithmetic),
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    corpus = embedded_documents()
    for name, (source, make) in TASKS.items():
        out = args.output / name
        out.mkdir(parents=True, exist_ok=True)
        for split, documents in split_documents(source, corpus[source]).items():
            examples = make(documents, random.Random(f"{SEED}-{name}-{split}"))[: LIMITS[split]]
            text = "".join(json.dumps(e) + "\n" for e in examples)
            (out / f"{split}.jsonl").write_text(text)
            print(f"{name}/{split}: {len(examples)} examples")


if __name__ == "__main__":
    main(sys.argv[1:])
