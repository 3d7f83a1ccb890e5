"""Writes what the model sees: the global batch of each of the first N steps, for any data config.

The work is maxtrain.data.show (python tools/show_data.py --help).
"""

import sys

from maxtrain.data.show import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
