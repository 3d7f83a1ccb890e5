"""Writes easy arithmetic problems for GRPO (train.task grpo, docs/rl.md): sums of two numbers
of up to --digits digits, in the committed arithmetic task's wording (maxtrain/evaluation/tasks/
arithmetic), as {"prompt", "completion"} lines (data.sources format: prompts).

    python tools/make_arithmetic_prompts.py OUT.jsonl [--n 2000] [--digits 2] [--seed 0]
        [--sft SFT.jsonl --sft-n 3000]

--sft also writes other problems (none of OUT's) for a warm start by supervised fine-tuning: the
same lines are a chat source (format: chat reads prompt/completion pairs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from maxtrain.data.corpora.sums import problems


def write(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--digits", type=int, default=2, choices=[1, 2, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", type=Path, help="also write --sft-n other problems here")
    parser.add_argument("--sft-n", type=int, default=3000)
    args = parser.parse_args(argv)
    try:
        rows = problems(args.n + (args.sft_n if args.sft else 0), args.digits, args.seed)
    except ValueError as e:
        parser.error(str(e))
    write(args.output, rows[: args.n])
    if args.sft:
        write(args.sft, rows[args.n :])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
