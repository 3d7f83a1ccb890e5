"""Trains a sentencepiece tokenizer (BPE or unigram) from text, JSONL or Parquet files.

    python tools/train_tokenizer.py --input 'corpus/*.jsonl' --output tok --vocab-size
    32000 \\
        --model-type bpe

writes tok.model and tok.vocab (piece<TAB>score per line). The documents come through the same
reader as tools/prepare_data.py, with the same counted skips.

The settings are chosen for pre-training data, which must not be altered on the way in:
identity normalization, no whitespace collapsing and no dummy prefix make decode(encode(text))
return the text byte for byte (indentation, newlines and all), and byte fallback gives every
character a tokenization, so there is no <unk>. Digits are split one per token, as in the Llama
tokenizers, which helps arithmetic. Special ids: pad 0, unk 1, bos 2, eos 3.

Training is deterministic: documents in sorted-file order, no sampling or shuffling, one
thread and a fixed seed; the model does not record the input paths or the output prefix. The
same input gives a byte-identical model.
"""

from __future__ import annotations

import argparse
import io
import itertools
import re
import time
from pathlib import Path

import sentencepiece as spm

from maxtrain.common.errors import ArgumentParser, UserError, first_line, refuse
from maxtrain.common.files import write_atomic
from maxtrain.data.errors import DataError
from maxtrain.data.readers import FORMATS, DocumentReader

PROG = "train_tokenizer"
SEED = 0
_SPM_MESSAGE_PREFIX = re.compile(r"^\w+: (?:\S+\(\d+\) \[.*?\] )?")  # "INTERNAL: file.cc(1) [x] "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="GLOB")
    parser.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.model")
    parser.add_argument("--vocab-size", type=int, required=True, help="byte pieces included")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--field", default="text", help="JSONL field / Parquet column")
    parser.add_argument("--format", choices=("auto", *FORMATS), default="auto")
    parser.add_argument("--txt-split", choices=("file", "paragraph"), default="file")
    parser.add_argument("--max-docs", type=int, default=None, help="the first N documents only")
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters that get their own piece; the rarest fall back to bytes",
    )
    return parser.parse_args(argv)


def read_documents(reader: DocumentReader, max_docs: int | None) -> list[str]:
    docs = list(itertools.islice(reader, max_docs))  # max_docs None: all
    if not docs:
        raise DataError(f"no documents to train on; skipped: {dict(reader.skipped) or 'nothing'}")
    return docs


def train(docs: list[str], vocab_size: int, model_type: str, character_coverage: float) -> bytes:
    """The serialized model proto."""
    model = io.BytesIO()
    spm.set_random_generator_seed(SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(docs),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            max_sentence_length=max(len(d.encode()) for d in docs),  # a document is a sentence
            input_sentence_size=0,  # use every document, no sampling
            shuffle_input_sentence=False,
            num_threads=1,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. "Vocabulary size too high (400). Please set it to <= 287."
        raise DataError(_SPM_MESSAGE_PREFIX.sub("", first_line(e))) from e
    return model.getvalue()


def vocab_text(model: bytes) -> str:
    processor = spm.SentencePieceProcessor(model_proto=model)
    pieces = range(processor.vocab_size())
    return "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n" for i in pieces)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        if args.vocab_size < 1 or (args.max_docs is not None and args.max_docs < 1):
            raise DataError("--vocab-size and --max-docs must be at least 1")
        output = Path(args.output)
        if not output.parent.is_dir():
            raise DataError(f"output directory {output.parent} does not exist")
        reader = DocumentReader(args.input, args.format, args.field, args.txt_split)
        docs = read_documents(reader, args.max_docs)
        model = train(docs, args.vocab_size, args.model_type, args.character_coverage)
    except UserError as e:
        return refuse(PROG, e)
    model_path = output.with_name(output.name + ".model")
    write_atomic(model_path, model)
    write_atomic(output.with_name(output.name + ".vocab"), vocab_text(model).encode())
    skipped = reader.skipped.describe()
    print(
        f"{PROG}: wrote {model_path} ({args.model_type}, vocab {args.vocab_size}) from "
        f"{len(docs):,} documents in {time.perf_counter() - start:.1f} s; skipped: {skipped}"
    )
    return 0
