"""Trains one config with AdamW and with Muon, each at the best of a learning-rate sweep.

The work is maxtrain.benchmarks.optimizers (python tools/compare_optimizers.py --help).
"""

import sys

from maxtrain.benchmarks.optimizers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
