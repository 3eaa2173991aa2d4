"""Errors shared across kvpush that must be importable without torch."""


class ConfigError(ValueError):
    """A configuration problem a user can fix (bad flag, unsupported model, ...)."""
