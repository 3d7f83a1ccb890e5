"""Times the train step of a config and prints one JSON line.

The work is maxtrain.benchmarks.step (python tools/benchmark.py --help).
"""

import sys

from maxtrain.benchmarks.step import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
