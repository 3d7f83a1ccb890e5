"""One PNG comparing runs: loss (train and eval), learning rate, throughput and MFU.

The work is maxtrain.evaluation.plot (python tools/plot_metrics.py --help).
"""

import sys

from maxtrain.evaluation.plot import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
