"""Times checkpoint saves and the restore of a large train state through maxtrain's Checkpointer.

The work is maxtrain.benchmarks.checkpoint (python tools/benchmark_checkpoint.py --help).
"""

import sys

from maxtrain.benchmarks.checkpoint import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
