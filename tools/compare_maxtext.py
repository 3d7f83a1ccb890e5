"""maxtrain and MaxText compiled for the same TPU topology, side by side on the compiler's figures.

The work is maxtrain.benchmarks.maxtext (python tools/compare_maxtext.py --help).
"""

import sys

from maxtrain.benchmarks.maxtext import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
