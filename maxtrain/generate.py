"""Text from a trained or imported model: `python -m maxtrain.generate CHECKPOINT [key=value ...]`.

    python -m maxtrain.generate runs/base --prompt "def add(a, b):" --max-new-tokens 40
    python -m maxtrain.generate imported/ --prompts prompts.jsonl --output out.jsonl \\
        --temperature 0.8 --top-p 0.95 --seed 1 mesh.fsdp=4 mesh.tensor=2

CHECKPOINT is a step, tier or run directory (the newest complete step) or an imported Hugging
Face checkpoint; key=value overrides apply to the config saved with it (the mesh, above all).
Prompts are text (--prompt, or {"prompt": ...} lines of a JSONL file) or token ids
(--prompt-ids 1,2,3, or {"prompt_ids": [...]}), of any lengths, generated as one batch. Each
prompt's completion is printed; --output writes one JSON line per prompt with the token ids.
The tokenizer is the one beside the checkpoint, else the one the run's data was made with
(--tokenizer overrides). Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from maxtrain.common.errors import (
    ArgumentParser,
    UserError,
    escaped_text,
    non_negative_int,
    path_first,
    positive_float,
    positive_int,
    refuse,
)
from maxtrain.common.files import write_atomic

PROG = "generate"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.checkpoint, *args.overrides = path_first([args.checkpoint, *args.overrides])
    # Imported here: jax and the model take seconds to import, --help should not wait for them.
    from maxtrain.inference.decode import generate
    from maxtrain.inference.loading import find_tokenizer, load_model
    from maxtrain.inference.sampling import Sampling

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        requests = _read_prompts(args)
        model = load_model(args.checkpoint, args.overrides, _devices(args.devices))
        print(f"{PROG}: {model.source()}; compiling prefill and decode")
        tokenizer, special_tokens = find_tokenizer(model, args.tokenizer)
        texts = [r["prompt"] for r in requests if "prompt" in r]
        if texts and tokenizer is None:
            raise UserError(
                f"{args.checkpoint} has no tokenizer (its data is synthetic); pass --tokenizer "
                "or give prompts as token ids"
            )
        encoded = iter(tokenizer.encode(texts, add_special_tokens=special_tokens) if texts else [])
        prompts = [r["prompt_ids"] if "prompt_ids" in r else next(encoded) for r in requests]
        _check_ids(prompts, model.cfg.model.vocab_size)
        stop_ids = [tokenizer.eos_id] if tokenizer is not None else []

        def stopped(row: int, new: list[int]) -> bool:
            return any(s in tokenizer.decode(new) for s in args.stop)

        result = generate(
            model,
            prompts,
            args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            stop_ids=stop_ids + args.stop_id,
            stop_check=stopped if args.stop and tokenizer is not None else None,
            progress=True,
        )
    except UserError as e:
        return refuse(PROG, e)
    lines = []
    for request, prompt, new, finish in zip(
        requests, prompts, result.new_tokens, result.finish, strict=True
    ):
        line = {**request, "prompt_ids": list(prompt), "new_ids": new, "finish": finish}
        if tokenizer is not None:
            line["text"] = _cut(tokenizer.decode(new), args.stop)
            print(f"{request.get('prompt', tokenizer.decode(prompt))}{line['text']}")
        else:
            print(f"{list(prompt)} -> {new}")
        lines.append(line)
    print(f"{PROG}: step {model.step}, prompts {len(prompts)}: {result.throughput_line()}")
    if args.output is not None:
        write_atomic(args.output, "".join(json.dumps(line) + "\n" for line in lines))
        print(f"{PROG}: wrote {args.output}")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[dict]:
    """The prompts in order: --prompt, --prompt-ids, then the JSONL file's lines."""
    requests = [{"prompt": text} for text in args.prompt]
    for text in args.prompt_ids:
        try:
            requests.append({"prompt_ids": [int(t) for t in text.split(",")]})
        except ValueError:
            raise UserError(f"--prompt-ids {text!r} is not comma-separated integers") from None
    if args.prompts is not None:
        try:
            lines = Path(args.prompts).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --prompts {args.prompts}: {e}") from None
        for number, line in enumerate(lines, 1):
            if line.strip():
                requests.append(_request(line, f"{args.prompts}:{number}"))
    if not requests:
        raise UserError("no prompt given; pass --prompt TEXT, --prompt-ids IDS or --prompts FILE")
    return requests


def _request(line: str, where: str) -> dict:
    try:
        request = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg})") from None
    ok_text = isinstance(request, dict) and isinstance(request.get("prompt"), str)
    ids = request.get("prompt_ids") if isinstance(request, dict) else None
    ok_ids = isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    if ok_text == ok_ids:
        raise UserError(
            f'{where}: expected an object with "prompt" (text) or "prompt_ids" (integers)'
        )
    return request


def _check_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for prompt in prompts:
        bad = [i for i in prompt if not 0 <= i < vocab_size]
        if bad:
            raise UserError(
                f"prompt token id {bad[0]} is outside the model's vocab [0, {vocab_size})"
            )


def _cut(text: str, stops: list[str]) -> str:
    """text up to the first stop string (which is not kept)."""
    ends = [text.find(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def _devices(count: int | None):
    import jax

    if count is None:
        return None
    if count > len(jax.devices()):
        raise UserError(f"--devices {count}: only {len(jax.devices())} devices are visible")
    return jax.devices()[:count]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog=f"python -m maxtrain.{PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step, tier or run directory, or an imported model")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt")
    parser.add_argument("--prompt-ids", action="append", default=[], help="token ids: 1,2,3")
    parser.add_argument("--prompts", help='JSONL: {"prompt": TEXT} or {"prompt_ids": [...]}')
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0: every token")
    parser.add_argument("--top-p", type=positive_float, default=1.0, help="1: every token")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--stop",
        action="append",
        type=escaped_text,
        default=[],
        help=r"stop at this text; \n, \t, \r and \\ are escapes",
    )
    parser.add_argument("--stop-id", action="append", type=int, default=[], help="and this id")
    parser.add_argument("--tokenizer", help="a tokenizer file or directory (default: found)")
    parser.add_argument("--output", type=Path, help="write one JSON line per prompt here")
    parser.add_argument("--devices", type=positive_int, help="use the first N devices")
    return parser


if __name__ == "__main__":
    sys.exit(main())
