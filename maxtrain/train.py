"""`python -m maxtrain.train CONFIG.yml [key=value ...]`: train as the config says.

The loop and what it composes live in maxtrain/training/ (docs/architecture.md); the memory
pre-flight (maxtrain/analysis/preflight.py) sits above training, so it is handed in here.
"""

import sys

from maxtrain.analysis.preflight import check_memory
from maxtrain.training.loop import main

if __name__ == "__main__":
    sys.exit(main(preflight=check_memory))
