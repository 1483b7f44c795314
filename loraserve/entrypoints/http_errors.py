"""HTTP errors of the server: exceptions -> OpenAI error JSON with the right status, and the API key guard.

Every invalid request is 400, as OpenAI and vLLM answer it: a body that is not JSON, a wrong type, a missing
or bad value. Each error answered here is reported once to the server's `on_error` (its metrics), unless the
route already counted it under the request's adapter.
"""
from __future__ import annotations

import hmac

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve.engine.async_engine import EngineClosedError, EngineStepError, QueueFullError
from loraserve.entrypoints.openai_protocol import APIError
from loraserve.errors import LoRAConflictError, PromptTooLongError, UnknownLoRAError
from loraserve.lora.reader import AdapterReaderError
from loraserve.lora.resolver import LoRAPathOutsideRootError


def api_error_from(exc: BaseException) -> APIError:
    """The HTTP error for an exception from the engine or from checking a request."""
    if isinstance(exc, APIError):
        return exc
    message = str(exc) or type(exc).__name__
    if isinstance(exc, UnknownLoRAError):
        return APIError(404, message, code="model_not_found")
    if isinstance(exc, LoRAConflictError):
        return APIError(409, message, code="conflict")
    if isinstance(exc, LoRAPathOutsideRootError):
        return APIError(400, message, code="path_outside_lora_root")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, message, code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(503, message, code="queue_full")
    if isinstance(exc, EngineClosedError):
        return APIError(503, message, code="unavailable")
    if isinstance(exc, AdapterReaderError):  # the server's reader failed, not the request
        return APIError(500, message, code="adapter_reader_failed")
    if isinstance(exc, ValueError):
        return APIError(400, message)
    return APIError(500, message)


def outcome_of(status: int) -> str:
    """The `outcome` label of /metrics for a failed request."""
    return "overloaded" if status == 503 else "error" if status >= 500 else "rejected"


class APIKeyMiddleware:
    """Plain ASGI middleware: every /v1 path needs `Authorization: Bearer <key>`; others stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self._expected):
                what = "missing API key" if given is None else "incorrect API key"
                err = APIError(401, f"{what}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    """400 naming the first bad field (or the body, when it is not JSON)."""
    first = exc.errors()[0]
    param = ".".join(str(x) for x in first["loc"][1:]) or None
    message = f"{param}: {first['msg']}" if param else f"request body: {first['msg']}"
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Answer every error of the app's routes as OpenAI's error JSON; on_error(status) is told of each one not
    counted yet."""

    def answer(err: APIError, headers=None) -> JSONResponse:
        if not err.counted:
            on_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        return answer(api_error_from(exc))

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(_validation_error(exc))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return answer(err, getattr(exc, "headers", None))

    for exc_class in (APIError, ValueError, QueueFullError, EngineClosedError, EngineStepError):
        app.add_exception_handler(exc_class, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
