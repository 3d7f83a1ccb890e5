"""User mistakes in the data layer: one line on stderr and exit status 2, never a traceback.

A `DataError` is a user mistake (a glob that matches nothing, a missing tokenizer, a corrupt
shard, a vocab that does not fit the model): the command line prints its message as one line and
exits with status 2, no traceback. Bad records inside a corpus are not errors; readers count them
as skips instead, so one broken line never stops a large job but is never silently lost either.
"""

from maxtrain.common.errors import UserError


class DataError(UserError):
    """A user mistake in data paths, formats or files; the message names the file or pattern."""
