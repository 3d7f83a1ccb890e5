"""Measures the input pipeline alone: tokens/s through read, mix, pack and batch.

The work is maxtrain.benchmarks.data_pipeline (python tools/benchmark_data.py --help).
"""

import sys

from maxtrain.benchmarks.data_pipeline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
