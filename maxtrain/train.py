"""`python -m maxtrain.train CONFIG.yml [key=value ...]`: train as the config says.

The loop and what it composes live in maxtrain/training/ (docs/architecture.md).
"""

import sys

from maxtrain.training.loop import main

if __name__ == "__main__":
    sys.exit(main())
