"""What several test packages share: the simulated devices' XLA flags (xla_env.py), real runs
of the CLI in subprocesses (runs.py), data written to disk (data.py), numerics helpers
(numerics.py) and a NumPy emulation of ragged all-to-all (ragged_all_to_all_reference.py).
tests/ is on the import path (pyproject.toml), so a test imports `support.X`."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
BASE = REPO / "configs" / "base.yml"
