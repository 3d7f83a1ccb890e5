"""Looking at a training step without running it: its memory per device from the config alone
(memory.py, `tools/benchmark.py --dry-run`), and what its traced program computes
(program.py)."""
