"""Errors that reach the user as one line.

Every error raised for bad input (config, data, paths, models) is an `RlhfLabError`. The CLI prints
`error: <message>` and exits with code 2; no traceback from deep inside a library reaches the user.
Messages name the field, file or row at fault.
"""


class RlhfLabError(Exception):
    """Base class: a user-facing problem that is explained in one line."""


class ConfigError(RlhfLabError):
    """A config key, value or override is invalid (message names the dotted key)."""


class DataError(RlhfLabError):
    """A dataset, file or row is invalid (message names the file/dataset, row and field)."""


class ModelError(RlhfLabError):
    """A model or tokenizer cannot be loaded or does not fit the request."""
