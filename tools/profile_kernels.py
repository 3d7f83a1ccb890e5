"""Where a profiled step's GPU time goes: kernel time per step, grouped by what the kernels do.

The work is maxtrain.benchmarks.kernel_profile (python tools/profile_kernels.py --help).
"""

import sys

from maxtrain.benchmarks.kernel_profile import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
