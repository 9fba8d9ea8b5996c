"""Exceptions users see. Each names the problem in words; the CLI prints them without a traceback."""


class FerryError(Exception):
    """Base of every error ferrylm raises on purpose."""


class ConfigError(FerryError):
    """A model config or engine option that cannot work."""


class ModelLoadError(FerryError):
    """A model path that is missing, unreadable, truncated or of an unsupported kind."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no ferrylm family."""


class WorkerLostError(FerryError):
    """A rank of a parallel engine died, hung or failed: the engine cannot go on (the message names the rank)."""

    fatal = True
    """The engine is unusable from here: a server marks itself dead instead of retrying steps."""


class InvalidRequestError(FerryError):
    """A request the engine refuses: bad sampling values, prompt longer than the context, ..."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
        """Machine-readable kind, e.g. `context_length_exceeded` (the OpenAI error code)."""
