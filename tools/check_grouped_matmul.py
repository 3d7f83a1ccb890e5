"""Checks each grouped-matmul implementation against a float32 reference, and times it.

The work is maxtrain.benchmarks.grouped_matmul (python tools/check_grouped_matmul.py --help).
"""

import sys

from maxtrain.benchmarks.grouped_matmul import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
