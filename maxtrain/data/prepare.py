"""Tokenizes text, JSONL or Parquet files into a prepared source: ArrayRecord shards + metadata.

    python tools/prepare_data.py --input 'corpus/*.jsonl' --tokenizer tok.model --output
    data/web
    python tools/prepare_data.py --input 'corpus/*.jsonl' --tokenizer tok.model \
        --output data/web --output-format megatron      # data/web.bin + data/web.idx

With `--output-format megatron` the output is a Megatron-LM corpus instead, the PREFIX.bin /
PREFIX.idx pair Megatron's preprocess_data.py writes (maxtrain/data/megatron/prepare.py), for
`data.kind: megatron` here and for Megatron-LM itself. (`--format` names the input's format.)

Each document becomes one record of int32 token ids ending in EOS (the format is described in
maxtrain/data/shards.py); a config then names the shards, e.g. `path: data/web/*.arrayrecord`.
Records that cannot be documents (not UTF-8, not JSON, no text field, empty) are skipped and
counted, and the summary lists the counts by reason, with where the first few were
(file:line). Mistakes (a glob that matches nothing, a missing tokenizer, an output that already
holds a prepared source) are one line on stderr and exit status 2; a failed run leaves no
shards behind, and no output directory it created.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from maxtrain.common.errors import ArgumentParser, UserError, positive_int, refuse
from maxtrain.data.megatron.prepare import write_corpus
from maxtrain.data.readers import FORMATS, DocumentReader, Skipped
from maxtrain.data.shards import write_shards
from maxtrain.tokenizers import load_tokenizer

PROG = "prepare_data"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="GLOB")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="sentencepiece .model, tokenizer.json, or a directory holding either",
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR")
    parser.add_argument("--field", default="text", help="JSONL field / Parquet column")
    parser.add_argument("--format", choices=("auto", *FORMATS), default="auto", help="input")
    parser.add_argument(
        "--output-format",
        choices=("arrayrecord", "megatron"),
        default="arrayrecord",
        help="megatron: --output is a prefix; writes PREFIX.bin and PREFIX.idx",
    )
    parser.add_argument("--txt-split", choices=("file", "paragraph"), default="file")
    parser.add_argument("--docs-per-shard", type=positive_int, default=10_000)
    parser.add_argument("--tokens-per-shard", type=positive_int, default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace a prepared source")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace, reader: DocumentReader) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    with tqdm(unit=" doc", file=sys.stderr, disable=None, desc=PROG) as bar:
        tokens = 0

        def progress(documents: int, new_tokens: int) -> None:
            nonlocal tokens
            tokens += new_tokens
            bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)
            bar.update(documents)

        if args.output_format == "megatron":
            return write_corpus(
                reader,
                tokenizer,
                args.output,
                skipped=reader.skipped,
                overwrite=args.overwrite,
                on_progress=progress,
            )
        return write_shards(
            reader,
            tokenizer,
            args.output,
            docs_per_shard=args.docs_per_shard,
            tokens_per_shard=args.tokens_per_shard,
            inputs=[str(f) for f in reader.files],
            skipped=reader.skipped,
            overwrite=args.overwrite,
            on_progress=progress,
        )


def summary(metadata: dict, output: Path, seconds: float, skipped: Skipped) -> str:
    if "files" in metadata:  # a Megatron pair
        written = f"{' and '.join(metadata['files'])} (end-of-document id {metadata['eod_id']})"
    else:
        written = f"{output} ({len(metadata['shards'])} shards)"
    return (
        f"{PROG}: wrote {written}: {metadata['documents']:,} documents, "
        f"{metadata['tokens']:,} tokens in {seconds:.1f} s "
        f"({metadata['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)\n"
        f"{PROG}: skipped records: {skipped.describe()}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        reader = DocumentReader(args.input, args.format, args.field, args.txt_split)
        metadata = prepare(args, reader)
    except UserError as e:
        return refuse(PROG, e)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the shards written so far were removed", file=sys.stderr)
        return 130
    print(summary(metadata, args.output, time.perf_counter() - start, reader.skipped))
    return 0
