"""Writes the committed fine-tuning examples, made offline from the embedded corpus.

    python tools/make_chat_data.py --out-dir maxtrain/data/assets

chat.jsonl         conversations: a math question of the embedded worksheets and its worked
                   answer (some with a system turn, some two questions long), and requests to
                   explain a Python topic answered with the opening of its pydoc reference text
preference.jsonl   pairs over other math questions: chosen = the worked answer, rejected = the
                   bare result without the working (a preference for showing one's working)

Deterministic on one interpreter (the embedded corpus is). The files are small enough to
commit, so `configs/sft.yml` and `configs/dpo.yml` run offline from a fresh checkout.
"""

from __future__ import annotations

import json
import pydoc_data.topics
import random
import sys
from pathlib import Path

from maxtrain.common.errors import ArgumentParser
from maxtrain.data.corpora.embedded import math_documents

SEED = 20_261_124
MAX_ANSWER_CHARS = 400  # keeps every example within a 256-token row of the default tokenizer
SYSTEM = "You are a careful assistant. Show your working."


def math_problems() -> list[tuple[str, str]]:
    """(question, worked answer) of every problem of the embedded math worksheets."""
    problems = []
    for document in math_documents():
        for block in document.split("\n\n"):
            question, _, answer = block.partition("\nA: ")
            problems.append((question.removeprefix("Q: "), answer))
    return [p for p in problems if len(p[1]) <= MAX_ANSWER_CHARS]


def topic_conversations() -> list[list[dict[str, str]]]:
    """Explain-this-topic requests answered with the topic's first paragraphs."""
    conversations = []
    for name, text in sorted(pydoc_data.topics.topics.items()):
        body = text.split("\n\n", 2)[-1] if "*****" in text else text
        answer = body[:MAX_ANSWER_CHARS].rsplit("\n", 1)[0].strip()
        if answer:
            conversations.append(
                [
                    {"role": "user", "content": f"Explain the Python topic {name!r}."},
                    {"role": "assistant", "content": answer},
                ]
            )
    return conversations


def chat_examples(problems: list[tuple[str, str]], rng: random.Random) -> list[dict]:
    examples = []
    for i in range(0, len(problems) - 1, 2):
        (q1, a1), (q2, a2) = problems[i], problems[i + 1]
        kind = rng.random()
        if kind < 0.2:  # two questions in one conversation
            messages = [
                {"role": "user", "content": q1},
                {"role": "assistant", "content": a1},
                {"role": "user", "content": q2},
                {"role": "assistant", "content": a2},
            ]
            examples.append({"messages": messages})
        elif kind < 0.4:  # with a system turn
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": q1},
                {"role": "assistant", "content": a1},
            ]
            examples.append({"messages": messages})
        else:  # the prompt/completion form
            examples.append({"prompt": q1, "completion": a1})
    examples += [{"messages": m} for m in topic_conversations()]
    rng.shuffle(examples)
    return examples


def preference_pairs(problems: list[tuple[str, str]]) -> list[dict]:
    """Working shown is preferred: chosen = the worked answer, rejected = its result alone."""
    pairs = []
    for question, answer in problems:
        result = answer.rsplit("= ", 1)[-1]
        if result != answer:
            pairs.append({"prompt": question, "chosen": answer, "rejected": result})
    return pairs


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"make_chat_data: wrote {path}: {len(rows)} examples")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="make_chat_data", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=1200)
    parser.add_argument("--pairs", type=int, default=1000)
    args = parser.parse_args(argv)
    rng = random.Random(SEED)
    problems = math_problems()
    rng.shuffle(problems)
    # Chat and preference examples come from disjoint problems.
    chat_problems, pair_problems = problems[: 2 * args.conversations], problems[-args.pairs :]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "chat.jsonl", chat_examples(chat_problems, rng))
    write_jsonl(args.out_dir / "preference.jsonl", preference_pairs(pair_problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
