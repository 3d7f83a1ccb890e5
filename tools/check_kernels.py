"""Checks each attention implementation against the plain-jnp reference, and times it.

The work is maxtrain.benchmarks.attention_kernels (python tools/check_kernels.py --help).
"""

import sys

from maxtrain.benchmarks.attention_kernels import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
