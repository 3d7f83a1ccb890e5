"""User mistakes in the data layer: one line on stderr and exit status 2, never a traceback.

A `DataError` is a user mistake (a glob that matches nothing, a missing tokenizer, a corrupt
shard, a vocab that does not fit the model): the command line prints its message as one line and
exits with status 2, no traceback. Bad records inside a corpus are not errors; readers count them
as skips instead, so one broken line never stops a large job but is never silently lost either.
"""

import argparse
from typing import NoReturn


class DataError(Exception):
    """A user mistake in data paths, formats or files; the message names the file or pattern."""


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a bad one is a usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """The data tools' parser: a usage mistake is one line `PROG: error: ...` and exit 2 too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
