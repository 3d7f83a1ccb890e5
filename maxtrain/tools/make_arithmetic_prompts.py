"""Writes easy arithmetic problems for GRPO (train.task grpo, docs/rl.md): sums of two numbers
of 1 to --digits digits, in the committed arithmetic task's wording (maxtrain/evaluation/tasks/
arithmetic), as {"prompt", "completion"} lines (data.sources format: prompts).

    python -m maxtrain.tools.make_arithmetic_prompts OUT.jsonl [--n 2000] [--digits 1] [--seed 0]

The same file is a chat source too (format: chat reads prompt/completion pairs): a warm start
by supervised fine-tuning on other problems (--seed) teaches the answer's format.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def problems(n: int, digits: int, seed: int) -> list[dict[str, str]]:
    """n distinct-seeded sums a + b, each operand 0 .. 10**digits - 1."""
    rng = random.Random(seed)
    top = 10**digits - 1
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, top), rng.randint(0, top)
        prompt = f"Q: What is {a} + {b}?\nA: {a} + {b} ="
        rows.append({"prompt": prompt, "completion": f" {a + b}."})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--digits", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = problems(args.n, args.digits, args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
