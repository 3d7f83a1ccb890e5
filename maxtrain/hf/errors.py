"""The one error the converters raise for a user's input."""

from maxtrain.common.errors import UserError


class ConversionError(UserError):
    """Bad or unsupported input (a missing file or tensor, a shape the config does not imply,
    an architecture or option we do not model). The message is one line naming the file or
    tensor and what was expected; the CLI prints it and exits with status 2."""
