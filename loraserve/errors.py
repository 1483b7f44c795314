"""Errors the engine raises; each names the problem.

Bad input: ValueError subclasses, so `except ValueError` catches every
bad-input case; the server maps each class to its HTTP status. An engine that
can't go on raises EngineDeadError (the server answers 503 and exits).
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


class EngineDeadError(RuntimeError):
    """The engine can't serve any more requests (HTTP 503); only a new engine can."""


class WorkerDiedError(EngineDeadError):
    """A worker process of a tensor-parallel engine died (names which, its exit code and its error)."""
