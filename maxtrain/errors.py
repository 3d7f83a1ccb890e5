"""The text of one-line error messages.

A user mistake or a failed operation is reported as one line that names what failed and why
(DESIGN.md). Errors from libraries (Orbax, tensorstore, YAML, sentencepiece, jax.distributed)
often carry pages of context after their first line; the first line is the one that says what
went wrong, so that is the part a message quotes.
"""

from __future__ import annotations

import os
import re


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
