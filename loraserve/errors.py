"""Errors the engine raises for bad input; each names the problem.

All are ValueError subclasses so `except ValueError` catches every bad-input
case; the server maps each class to its HTTP status.
"""


class InvalidRequestError(ValueError):
    """A request's values are wrong (HTTP 400)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit max_model_len (HTTP 400)."""


class UnknownLoRAError(ValueError):
    """A request or call names an adapter that is not registered (HTTP 404)."""


class LoRAConflictError(ValueError):
    """An adapter name is already registered with another path (HTTP 409)."""


class ModelLoadError(ValueError):
    """The model can't be loaded: path, files, or architecture (names which)."""
