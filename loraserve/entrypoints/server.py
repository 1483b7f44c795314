"""The OpenAI-compatible HTTP server: `build_app(engine, settings)` returns its FastAPI app.

Routes: /v1/completions and /v1/chat/completions (JSON, or SSE with
`stream=true`), /v1/models, /v1/models/{id}, /v1/load_lora_adapter and
/v1/unload_lora_adapter (only with runtime updates on), /tokenize and
/detokenize, /health and /ping, /version, /metrics; CORS headers as the
settings allow.
A client that goes away aborts its engine requests, which frees their KV
blocks and adapter references. docs/server.md describes the API.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraserve.engine.async_engine import AsyncLLMEngine, EngineClosedError, GenerationRequest, OutputStream
from loraserve.entrypoints.http_errors import APIKeyMiddleware, api_error_from, install_error_handlers, outcome_of
from loraserve.entrypoints.metrics import BASE_MODEL_LABEL, UNKNOWN_MODEL_LABEL, ServerMetrics, TokenTimer
from loraserve.entrypoints.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                   DetokenizeRequest, LoadLoRAAdapterRequest, ResponseBuilder,
                                                   TokenizeRequest, UnloadLoRAAdapterRequest, template_messages)
from loraserve.entrypoints.version import package_version
from loraserve.errors import InvalidRequestError
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAPathOutsideRootError, resolve_adapter_path


@dataclass(frozen=True)
class ServerSettings:
    """What the app serves; the engine itself is configured separately."""

    served_model_names: tuple[str, ...] = ()  # the base model's names; the first is listed (default: engine's)
    api_key: str | None = None  # required as "Authorization: Bearer <key>" on every /v1 route
    enable_runtime_lora_updates: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_roots: tuple[str, ...] = ()  # runtime adapter paths must resolve inside one of these
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) registered at start, shown in /v1/models
    # CORS (browsers calling the API from other origins), as vLLM sets it by default
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.enable_runtime_lora_updates and not self.lora_roots:
            raise ValueError("runtime LoRA updates need at least one lora root (--lora-root)")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStreamResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, failed, client gone, not started)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _OpenAIServer:
    """The route handlers of one app, around one AsyncLLMEngine."""

    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings):
        self.engine = engine
        self.model_names = settings.served_model_names or (engine.model_name,)
        self.adapter_paths = dict(settings.lora_modules)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._lora_roots = settings.lora_roots
        tokenizer = engine.tokenizer  # None for models served by token ids only
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda tid: tokenizer.decode([tid]) if tokenizer is not None else f"<{tid}>")
        self.decode_ids = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else \
            (lambda ids: "".join(map(self.token_text, ids)))

    # ---- generation -----------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        make = body.sampling_params()
        return await self._generate(request, body, body.prompts(), make, chat=False, arrival=arrival)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        body.check_unknown_fields()
        messages = body.check_messages()
        prompt_ids = await self.engine.apply_chat_template(messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is None:
            limit = max(1, self.engine.max_model_len - len(prompt_ids))
        make = body.make_sampling_params(limit, body.num_logprobs)
        return await self._generate(request, body, [prompt_ids], make, chat=True, arrival=arrival)

    @staticmethod
    def _choice_params(make, i: int, body):
        """Choice i's sampling params. A full response shows each prompt's prompt logprobs from its first choice
        alone, so its other choices do not compute them (and may take that choice's cached prompt)."""
        params = make(i)
        if not body.stream and i % body.n and params.prompt_logprobs is not None:
            params = replace(params, prompt_logprobs=None)
        return params

    async def _generate(self, request: Request, body, prompts: list, make, *, chat: bool, arrival: float) -> Response:
        is_base = body.model in self.model_names
        lora, label = (None, BASE_MODEL_LABEL) if is_base else (LoRARequest(body.model), body.model)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        specs = [GenerationRequest(f"{response_id}-{i}", prompts[i // body.n], self._choice_params(make, i, body),
                                   lora) for i in range(len(prompts) * body.n)]
        try:
            stream = await self.engine.add_requests(specs)
        except Exception as exc:
            err = api_error_from(exc)
            if err.status == 404 and lora is not None:  # say which models exist, as OpenAI and vLLM do
                models = [self.model_names[0], *await self.engine.list_loras()]
                err = APIError(404, f"the model {body.model!r} does not exist; the models are "
                                    f"{', '.join(repr(m) for m in models)} ({exc})", param="model",
                               code="model_not_found")
            known = lora is None or body.model in self.adapter_paths  # no label per unknown name
            self.metrics.record_request(label if known and err.status != 404 else UNKNOWN_MODEL_LABEL,
                                        outcome_of(err.status))
            err.counted = True
            raise err from exc
        params = specs[0].params
        echo = not chat and body.echo
        builder = ResponseBuilder(
            chat=chat, response_id=response_id, model=body.model, created=int(time.time()), num_choices=len(specs),
            n=body.n, num_logprobs=params.logprobs, stop_strings=params.stop_strings, token_text=self.token_text,
            detokenize=self.decode_ids, echo=echo, echo_only=echo and body.echo_only,
            num_prompt_logprobs=None if body.stream else params.prompt_logprobs,
            continuous_usage=body.continuous_usage)
        index = {spec.request_id: i for i, spec in enumerate(specs)}
        timer = TokenTimer(self.metrics, arrival)
        if body.stream:
            outcome = ["aborted"]  # kept if the client goes away: the response task is then cancelled

            def on_close() -> None:
                stream.abort()
                self.metrics.record_request(label, outcome[0])

            events = self._stream_events(stream, builder, index, timer, body.include_usage, outcome)
            return _EventStreamResponse(events, on_close)
        return await self._complete(request, stream, builder, index, timer, label)

    async def _complete(self, request: Request, stream: OutputStream, builder: ResponseBuilder,
                        index: dict[str, int], timer: TokenTimer, label: str) -> Response:
        async def consume() -> None:
            async for out in stream:
                timer.observe(out)
                builder.accept(index[out.request_id], out)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            consumer.cancel()
            stream.abort()
        if not consumer.done() or consumer.cancelled():  # the client went away first
            self.metrics.record_request(label, "aborted")
            return Response(status_code=499)
        if consumer.exception() is not None:
            err = api_error_from(consumer.exception())
            self.metrics.record_request(label, outcome_of(err.status))
            err.counted = True
            raise err
        self.metrics.record_request(label, "success")
        return JSONResponse(builder.response())

    @staticmethod
    async def _stream_events(stream: OutputStream, builder: ResponseBuilder, index: dict[str, int],
                             timer: TokenTimer, include_usage: bool, outcome: list[str]) -> AsyncIterator[str]:
        """The SSE lines of a streamed answer; sets outcome[0] when it ends by itself."""
        try:
            for chunk in builder.role_chunks():
                yield _sse(chunk)
            async for out in stream:
                timer.observe(out)
                i = index[out.request_id]
                builder.accept(i, out)
                chunk = builder.delta_chunk(i)
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage:
                yield _sse(builder.usage_chunk())
            outcome[0] = "success"
        except Exception as exc:  # the engine failed mid-stream: tell the client in the stream
            err = api_error_from(exc)
            outcome[0] = outcome_of(err.status)
            yield _sse(err.body())
        yield "data: [DONE]\n\n"

    # ---- models and adapters ----------------------------------------------------------

    def _model_card(self, name: str, root: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "loraserve",
                "root": root, "parent": None, "max_model_len": self.engine.max_model_len}

    def _adapter_card(self, name: str, path: str, on_gpu: bool) -> dict:
        """An adapter's card: its folder as `root`, the base model as `parent`, and whether its weights
        are resident on the GPU now (`resident_on_gpu`; false: they are copied in on its next use)."""
        return {**self._model_card(name, path), "parent": self.model_names[0], "resident_on_gpu": on_gpu}

    async def list_models(self) -> dict:
        base = self.model_names[0]
        loras = await self.engine.lora_residency()
        return {"object": "list", "data": [self._model_card(base, base)]
                + [self._adapter_card(name, path, on_gpu) for name, (path, on_gpu) in loras.items()]}

    async def get_model(self, model_id: str) -> dict:
        if model_id in self.model_names:
            return self._model_card(model_id, model_id)
        loras = await self.engine.lora_residency()
        if model_id in loras:
            return self._adapter_card(model_id, *loras[model_id])
        raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> dict:
        body.check_unknown_fields()
        name = body.lora_name
        if not name:
            raise APIError(400, "lora_name must not be empty", param="lora_name")
        if name in self.model_names:
            raise APIError(409, f"lora_name {name!r} is the base model's name", param="lora_name", code="conflict")
        try:
            path = resolve_adapter_path(body.lora_path, self._lora_roots)
        except LoRAPathOutsideRootError as exc:
            raise APIError(400, str(exc), param="lora_path", code="path_outside_lora_root") from exc
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="lora_path") from exc
        await self.engine.add_lora(LoRARequest(name, path))
        self.adapter_paths[name] = path
        return {"object": "lora_adapter", "id": name, "root": path, "status": "loaded"}

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> dict:
        body.check_unknown_fields()
        await self.engine.remove_lora(body.lora_name)
        self.adapter_paths.pop(body.lora_name, None)
        return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}

    # ---- tokenizer ------------------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict:
        body.check()
        await self._check_model(body.model)
        if body.messages is not None:
            ids = await self.engine.apply_chat_template(template_messages(body.messages), body.add_generation_prompt,
                                                        bool(body.add_special_tokens))
        else:
            ids = await self.engine.tokenize(body.prompt, body.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": None}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        body.check_unknown_fields()
        await self._check_model(body.model)
        return {"prompt": await self.engine.detokenize(body.tokens)}

    async def _check_model(self, model: str | None) -> None:
        """404 unless `model` is None, the base model's name or a registered adapter's."""
        if model is None or model in self.model_names:
            return
        loras = await self.engine.list_loras()
        if model not in loras:
            names = ", ".join(repr(m) for m in [self.model_names[0], *loras])
            raise APIError(404, f"the model {model!r} does not exist; the models are {names}", param="model",
                           code="model_not_found")

    # ---- health and metrics -----------------------------------------------------------

    async def health(self) -> Response:
        if self.engine.is_alive():
            return Response(status_code=200)
        return JSONResponse(APIError(503, "the engine is not running").body(), status_code=503)

    async def version(self) -> dict:
        return {"version": package_version()}

    async def metrics_text(self) -> Response:
        try:
            self.metrics.update(await self.engine.stats())
        except EngineClosedError:
            pass  # serve the last snapshot
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})


def build_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The app for an engine (the caller starts and shuts down the engine)."""
    server = _OpenAIServer(engine, settings)
    app = FastAPI(title="loraserve", docs_url=None, redoc_url=None)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    # added last, so outermost: a browser's preflight request is answered before the API key is asked for
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials)
    # errors not counted by a route (refused before the request's model was looked at) count as __unknown__
    install_error_handlers(app, lambda status: server.metrics.record_request(UNKNOWN_MODEL_LABEL,
                                                                             outcome_of(status)))
    app.get("/health")(server.health)
    app.get("/ping")(server.health)  # vLLM's (and SageMaker's) name for it
    app.post("/ping")(server.health)
    app.get("/version")(server.version)
    app.get("/metrics")(server.metrics_text)
    app.get("/v1/models")(server.list_models)
    app.get("/v1/models/{model_id:path}")(server.get_model)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    if settings.enable_runtime_lora_updates:
        app.post("/v1/load_lora_adapter")(server.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(server.unload_lora_adapter)
    return app
