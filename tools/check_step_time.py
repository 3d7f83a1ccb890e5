"""The step-time model against measured step times: MaxText's published runs and maxtrain's H100.

The work is maxtrain.benchmarks.step_time_check (python tools/check_step_time.py --help).
"""

import sys

from maxtrain.benchmarks.step_time_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
