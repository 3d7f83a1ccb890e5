"""One-line errors: the text of a message, the user's mistakes, and how a command reports them.

A user mistake or a failed operation is reported as one line that names what failed and why
(DESIGN.md). Errors from libraries (Orbax, tensorstore, YAML, sentencepiece, jax.distributed)
often carry pages of context after their first line; the first line is the one that says what
went wrong, so that is the part a message quotes.

Every refused input (a config value, an override, a file, a data shard, a tokenizer, a
checkpoint, a Hugging Face directory, a tool argument) raises a `UserError`. Every command line
catches it and calls `refuse`: `PROG: error: <one line>` on stderr, exit status 2, no traceback.
`--debug` (or MAXTRAIN_DEBUG=1) re-raises it instead, for whoever debugs maxtrain itself.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from typing import NoReturn

DEBUG_ENV = "MAXTRAIN_DEBUG"


class UserError(Exception):
    """A mistake in what the user gave: printed as one line, exit status 2.

    The message names the offending key, path or value and what is expected. Subclasses say
    where it was found: ConfigError, DataError, CheckpointError, ConversionError.
    """


def first_line(error: BaseException | str, limit: int | None = None, *, typed: bool = False) -> str:
    """The first line of an error's message (or of a text), at most `limit` characters.

    An error without a message gives its type name. typed: prefix the type name
    ("FileNotFoundError: ..."), for messages that could mean several things without it.
    """
    line = next(iter(str(error).strip().splitlines()), "")
    if typed:
        text = f"{type(error).__name__}: {line}"
    else:
        text = line or type(error).__name__
    return text[:limit]


def one_line(error: BaseException | str) -> str:
    """An error's whole message on one line (its lines joined), or its type name if empty."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


def debugging() -> bool:
    """Whether refused inputs should raise with their traceback (--debug, MAXTRAIN_DEBUG=1)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def refuse(prog: str, error: UserError) -> int:
    """Reports a refused input as `PROG: error: <one line>` on stderr and returns exit status 2;
    under --debug / MAXTRAIN_DEBUG=1 with its traceback first, the exit status the same."""
    if debugging():
        traceback.print_exception(error, file=sys.stderr)
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
    return 2


def path_first(positionals: list[str]) -> list[str]:
    """A command's positionals with its one path (a config file, a checkpoint: the one that is
    no key=value override) first, wherever it stood: `generate mesh.fsdp=1 runs/default` is
    `generate runs/default mesh.fsdp=1`, not a checkpoint named "mesh.fsdp=1". The overrides
    keep their order; with no path or several, nothing moves (the caller refuses them)."""
    paths = [p for p in positionals if "=" not in p]
    if len(paths) != 1:
        return positionals
    return [*paths, *(p for p in positionals if "=" in p)]


class _Debug(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        os.environ[DEBUG_ENV] = "1"  # seen by `refuse`, and by the tools a tool runs


class ArgumentParser(argparse.ArgumentParser):
    """Every tool's parser: a usage mistake is one line `PROG: error: ...` and exit 2 too, and
    --debug turns on tracebacks (the same as MAXTRAIN_DEBUG=1).

    One grammar for every command: positionals (a checkpoint, a config, `key=value` overrides)
    may stand anywhere among the options, before, between or after them, as a user appends an
    override to a command copied from the docs. Plain argparse stops a `nargs="*"` positional
    at the first option and refuses whatever positional follows the options.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug", nargs=0, action=_Debug, help=f"show tracebacks (or {DEBUG_ENV}=1)"
        )

    def parse_args(self, args=None, namespace=None):
        """Options and positionals intermixed (argparse's parse_intermixed_args); a parser
        with subcommands parses as plain argparse does (intermixing cannot split them), and
        each subcommand's own options follow its name."""
        if self._subparsers is not None:
            return super().parse_args(args, namespace)
        return self.parse_intermixed_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a bad one is a usage error, exit 2)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}  # what `escaped_text` turns into
_ESCAPE = re.compile(r"\\(.?)", re.DOTALL)


def escaped_text(text: str) -> str:
    r"""An argparse type: text with the backslash escapes a user types for what a shell does
    not pass plainly (in bash, `--stop "\n\n"` is a backslash and an n, twice): \n newline,
    \t tab, \r carriage return, \\ one backslash. Any other backslash is refused rather than
    kept, so that a mistyped escape never silently matches nothing."""

    def one(match: re.Match) -> str:
        if match.group(1) not in ESCAPES:
            raise argparse.ArgumentTypeError(
                f"unknown escape \\{match.group(1)} in '{text}'; expected \\n, \\t, \\r or "
                "\\\\ (a backslash)"
            )
        return ESCAPES[match.group(1)]

    return _ESCAPE.sub(one, text)


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")  # how tensorstore tags a failed syscall


def cause(error: BaseException, limit: int | None = 300) -> str:
    """What an error comes down to, for a message that must say why in a few words.

    A library error's first line often names only the operation (Orbax: "RESOURCE_EXHAUSTED:
    Error writing ... in OCDBT database at ..."), with the reason at the end of a 300-character
    line or in an exception it chains or groups. The innermost OS error found wins, as its
    description ("No space left on device"): an OSError in the chain (__cause__, __context__,
    the members of an ExceptionGroup), or the errno tensorstore appends to its messages
    ("[os_error_code='28']"). Without one, the first line of the error (type name first).
    """
    seen, level, found = set(), [error], None
    while level:  # breadth first: a reason found deeper replaces one found above it
        below = []
        for e in level:
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, OSError) and e.errno:
                found = e.strerror or os.strerror(e.errno)
            elif match := _OS_ERROR_CODE.search(str(e)):
                found = os.strerror(int(match.group(1)))
            below += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        level = below
    return found if found is not None else first_line(error, limit, typed=True)
