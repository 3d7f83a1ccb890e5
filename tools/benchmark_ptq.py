"""Bytes on disk of a float parameters-only checkpoint against its post-training quantizations.

The work is maxtrain.benchmarks.ptq (python tools/benchmark_ptq.py --help).
"""

import sys

from maxtrain.benchmarks.ptq import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
