"""The text of one-line error messages.

A user mistake or a failed operation is reported as one line that names what failed and why
(DESIGN.md). Errors from libraries (Orbax, tensorstore, YAML, sentencepiece, jax.distributed)
often carry pages of context after their first line; the first line is the one that says what
went wrong, so that is the part a message quotes.
"""

from __future__ import annotations


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
