"""Two-number sums in the committed arithmetic task's wording (maxtrain/evaluation/tasks/
arithmetic): the prompts GRPO learns from (configs/grpo.yml) and the SFT warm start's examples
(configs/sums-sft.yml), written by tools/make_arithmetic_prompts.py."""

from __future__ import annotations

import random


def problems(n: int, digits: int, seed: int) -> list[dict[str, str]]:
    """n distinct sums a + b, each operand 0 .. 10**digits - 1, in a seeded order, as
    {"prompt", "completion"} rows (data.sources format: prompts)."""
    size = 10**digits
    if n > size * size:
        raise ValueError(f"{digits} digits make only {size * size} distinct problems, not {n}")
    rows = []
    for k in random.Random(seed).sample(range(size * size), n):
        a, b = divmod(k, size)
        prompt = f"Q: What is {a} + {b}?\nA: {a} + {b} ="
        rows.append({"prompt": prompt, "completion": f" {a + b}."})
    return rows
