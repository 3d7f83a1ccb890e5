"""Tokenizes text, JSONL or Parquet files into a prepared source: ArrayRecord shards + metadata.

The work is maxtrain.data.prepare (python tools/prepare_data.py --help).
"""

import sys

from maxtrain.data.prepare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
