"""Which layout for my slice: plans a config's mesh, remat and micro-batches for a topology.

The work is maxtrain.planning.plan (python tools/plan.py --help; docs/planning.md).
"""

import sys

from maxtrain.planning.plan import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
