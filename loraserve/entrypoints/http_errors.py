"""HTTP errors of the server: exceptions -> OpenAI error JSON with the right status, and the API key guard.

Wrong types and bodies that are not JSON are 422; every other invalid request is 400.
"""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve.engine.async_engine import EngineClosedError, EngineStepError, QueueFullError
from loraserve.entrypoints.openai_protocol import APIError
from loraserve.errors import LoRAConflictError, PromptTooLongError, UnknownLoRAError
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


async def _api_error_response(request: Request, exc: Exception) -> JSONResponse:
    err = api_error_from(exc)
    return JSONResponse(err.body(), status_code=err.status)


async def _validation_error_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 for a body that is not JSON or has a wrong type; 400 for a missing or bad value."""
    errors = exc.errors()
    wrong_type = any(e["type"] == "json_invalid" or e["type"].endswith(("_type", "_parsing"))
                     or tuple(e["loc"]) == ("body",) for e in errors)
    first = errors[0]
    param = ".".join(str(x) for x in first["loc"][1:]) or None
    message = f"{param}: {first['msg']}" if param else f"request body: {first['msg']}"
    err = APIError(422 if wrong_type else 400, message, param=param)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of the app's routes as OpenAI's error JSON."""
    for exc_class in (APIError, ValueError, QueueFullError, EngineClosedError, EngineStepError):
        app.add_exception_handler(exc_class, _api_error_response)
    app.add_exception_handler(RequestValidationError, _validation_error_response)
    app.add_exception_handler(StarletteHTTPException, _http_error_response)
