"""A user mistake in the config: the CLI prints it as one line and exits with status 2
(common/errors.py)."""

from maxtrain.common.errors import UserError


class ConfigError(UserError):
    """A user mistake in the config: the CLI prints it as one line and exits with status 2."""
