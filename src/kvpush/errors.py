"""Errors shared across kvpush that must be importable without torch."""


class ConfigError(ValueError):
    """A configuration problem a user can fix (bad flag, unsupported model, ...)."""


class RequestError(ValueError):
    """A request the engine refuses up front (bad length, bad ids); maps to HTTP 400, or
    to ``status_code`` when the refusal is the instance's state, not the client's
    mistake (503: its engine core is gone)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status_code: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status_code = status_code
