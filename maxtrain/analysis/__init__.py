"""Looking at a training step without running it: its memory per device from the config alone
(memory.py, `maxtrain.tools.benchmark --dry-run`), and what its traced program computes
(program.py)."""
