"""absl flags, for libraries that read them while maxtrain runs outside absl.app."""

from __future__ import annotations


def mark_parsed() -> None:
    """Marks absl's flags parsed (at their defaults) if nothing parsed them yet.

    Orbax and grain's worker processes read absl flags, and reading one raises unless the flags
    were parsed, which absl.app does; maxtrain's entry points are plain Python. Call it before
    using either; it is cheap and idempotent.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
