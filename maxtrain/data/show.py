"""Writes what the model sees: the global batch of each of the first N steps, for any data config.

    python tools/show_data.py CONFIG.yml [key=value ...] --steps N --out batches.npz

The batches come from the train loop's own entry point (`maxtrain.training.loop.data_streams`), on
one
process, so every row of each global batch is there, in row order. The .npz holds one array per
key of the train step's batch, each [N, global_batch_size, seq_len] int32: `inputs`, `targets`,
`loss_mask`, `segment_ids`, `positions`. Diff it against another stack's token ids (for a
Megatron config, sample s of Megatron's train dataset is `inputs[s // B, s % B]` plus the last
`targets` token), or against an older run's file, to see whether two runs train on the same data.
Beside it, F.txt holds each row decoded to text, document by document, with the sources'
tokenizer (or --tokenizer); Megatron corpora do not record theirs.

`--show-loss R` also prints the first R rows of the first batch as text, the targets that carry
loss in [[double brackets]] and a | between segments: for chat data, the assistant's turns
should be bracketed and nothing else. The text is decoded with data.tokenizer (default: the
committed tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from maxtrain import config as config_lib
from maxtrain.common.errors import ArgumentParser, UserError, positive_int, refuse
from maxtrain.data import BATCH_KEYS, chat
from maxtrain.data.errors import DataError
from maxtrain.data.shards import data_tokenizer
from maxtrain.data.streams import data_streams
from maxtrain.tokenizers import load_tokenizer

PROG = "show_data"


def collect(cfg: config_lib.Config, steps: int) -> dict[str, np.ndarray]:
    """{key: [steps, global_batch_size, seq_len]} of the first `steps` global batches."""
    train, _ = data_streams(cfg)
    batches = []
    try:
        for _ in range(steps):
            batches.append(next(train))
    except StopIteration:
        raise DataError(f"the data ends after {len(batches)} steps, before {steps}") from None
    finally:
        if callable(getattr(train, "close", None)):
            train.close()
    return {k: np.stack([b[k] for b in batches]) for k in BATCH_KEYS}


def loss_view(
    inputs: np.ndarray, targets: np.ndarray, loss_mask: np.ndarray, segments: np.ndarray, decode
) -> str:
    """One row as text, runs of loss-carrying targets in [[ ]], segments split by |. A
    document's first token is an input only (no token before it predicts it): it leads its
    segment's text, outside the brackets (it was missing: "|im_start|>" for "<|im_start|>")."""
    keys = list(zip(segments, loss_mask, strict=True))
    text, start = [], 0
    for end in [*np.flatnonzero(np.diff(np.asarray(keys), axis=0).any(-1)) + 1, len(keys)]:
        segment, counted = keys[start]
        piece = decode(targets[start:end])
        first = start == 0 or segments[start - 1] != segment
        lead = decode(inputs[start : start + 1]) if first and segment != 0 else ""
        if segment == 0:
            piece = f"<{end - start} padding>"
        text.append(lead + (f"[[{piece}]]" if counted else piece))
        if end < len(keys) and segments[end] != segment:
            text.append(" | ")
        start = end
    return "".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--steps", type=positive_int, required=True)
    parser.add_argument("--out", type=Path, required=True, metavar="F.npz")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="sentencepiece model to decode with (default: the sources', where known)",
    )
    parser.add_argument("--show-loss", type=positive_int, default=0, metavar="R")
    args = parser.parse_args(argv)
    try:
        # The config is checked as the train loop checks it (eval streams included): what one
        # refuses, so does the other; only the train batches are written.
        cfg = config_lib.load(args.config, args.overrides)
        tokenizer_path = args.tokenizer or data_tokenizer(cfg.data)
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
        arrays = collect(cfg, args.steps)
    except UserError as e:
        return refuse(PROG, e)
    np.savez_compressed(args.out, **arrays)
    shape = "x".join(map(str, arrays["inputs"].shape))
    print(f"{PROG}: wrote {args.out}: {', '.join(BATCH_KEYS)} [{shape}] (steps x rows x tokens)")
    if tokenizer is None:
        print(f"{PROG}: no text: the sources' tokenizer is not known (pass --tokenizer)")
    else:
        text = args.out.with_suffix(".txt")
        text.write_text(decoded(arrays, tokenizer), encoding="utf-8")
        print(f"{PROG}: wrote {text}: each row decoded with {tokenizer_path}")
    if args.show_loss:
        decode = chat.load_tokenizer(cfg.data.tokenizer).decode
        for r in range(min(args.show_loss, arrays["inputs"].shape[1])):
            row = [arrays[k][0, r] for k in ("inputs", "targets", "loss_mask", "segment_ids")]
            print(f"row {r}: {loss_view(*row, decode)}")
    return 0


def decoded(arrays: dict[str, np.ndarray], tokenizer) -> str:
    """Every row as text, document by document (a new segment id starts a new line)."""
    out = []
    for step, rows in enumerate(arrays["inputs"]):
        for row, ids in enumerate(rows):
            segments = arrays["segment_ids"][step, row]
            out.append(f"=== step {step + 1} row {row}")
            for segment in dict.fromkeys(segments.tolist()):  # in order of appearance
                if segment:  # 0: padding
                    out.append(f"[{segment}] {tokenizer.decode(ids[segments == segment])}")
    return "\n".join(out) + "\n"
