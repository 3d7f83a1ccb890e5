"""Folds a LoRA run's adapters into its base: a plain checkpoint every tool reads as any model.

The work is maxtrain.posttrain.merge_cli (python tools/merge_lora.py --help).
"""

import sys

from maxtrain.posttrain.merge_cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
