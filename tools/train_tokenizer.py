"""Trains a sentencepiece tokenizer (BPE or unigram) from text, JSONL or Parquet files.

The work is maxtrain.tokenizers.train (python tools/train_tokenizer.py --help).
"""

import sys

from maxtrain.tokenizers.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
