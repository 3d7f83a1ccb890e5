"""Post-training quantization of a checkpoint: int8 or int4 weights plus per-channel scales.

The work is maxtrain.quantization.cli (python tools/quantize.py --help).
"""

import sys

from maxtrain.quantization.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
