"""AsyncLLMEngine: the synchronous LLMEngine driven by one background thread, for asyncio callers.

The engine is not thread-safe, so every call into it (add, abort, adapters,
stats, chat templates) is a command handed to that thread through a locked
queue and answered through a future. The thread runs commands, then one engine
step while requests are unfinished, and sleeps on a condition when idle.
Outputs go back to the asyncio loop that asked for them with
`loop.call_soon_threadsafe`. An engine that dies (EngineDeadError: a
tensor-parallel worker died) ends the thread: every request and call gets
EngineClosedError (HTTP 503) and `on_dead` is called with the error.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from loraserve.engine.stats import EngineStats
from loraserve.errors import EngineDeadError, InvalidRequestError
from loraserve.lora.request import LoRARequest
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests requests already (HTTP 503)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down or has stopped (HTTP 503)."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in flight were aborted (HTTP 500)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One request to add: id, prompt (text or token ids), sampling and adapter."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None


class OutputStream:
    """Async iterator over the outputs of a group of requests until every one has finished.

    Outputs of different requests of the group arrive interleaved; each is a
    cumulative RequestOutput. `abort()` stops the unfinished ones (idempotent).
    """

    def __init__(self, request_ids: Sequence[str], abort: Callable[[list[str]], None]):
        self.request_ids = tuple(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._open = set(self.request_ids)
        self._abort = abort

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the stream's event loop (through call_soon_threadsafe)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return item

    def abort(self) -> None:
        if self._open:
            ids = sorted(self._open)
            self._open.clear()
            self._abort(ids)


class AsyncLLMEngine:
    """Owns an LLMEngine and the one thread that calls it; see the module docstring.

    Requests that have been added but have produced no output yet count as
    waiting; adding more than `max_waiting_requests` of them raises
    QueueFullError. Call `start()` before use and `shutdown()` at the end.
    """

    def __init__(self, engine: Any, *, max_waiting_requests: int = 1024,
                 on_dead: Callable[[BaseException], None] | None = None):
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}")
        self._engine = engine
        self._on_dead = on_dead  # called on the engine thread when the engine dies
        self.dead: EngineDeadError | None = None  # why the engine stopped, if it died
        self._max_waiting = max_waiting_requests
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stopping = False
        self._closed = False
        # Touched by the engine thread only:
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._not_started: set[str] = set()

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        """For read-only use (decoding token ids); encoding happens on the engine thread."""
        return self._engine.tokenizer

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("AsyncLLMEngine.start() was called twice")
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        with self._cond:
            return self._thread is not None and not self._closed and self._thread.is_alive()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with drain, let the ones in flight finish, else abort them; join."""
        with self._cond:
            self._accepting = False
            thread = self._thread
            if thread is None:
                return
            if not drain and not self._closed:
                self._commands.append((self._abort_all, concurrent.futures.Future()))
            self._stopping = True
            self._cond.notify()
        thread.join(timeout)

    # ---- asyncio side -------------------------------------------------------------

    async def add_requests(self, requests: Sequence[GenerationRequest]) -> OutputStream:
        """Add a group of requests at once (all or none); errors of add_request are raised here.

        Adapters the requests name (without a path) that are not registered yet are looked up in the
        engine's lora root and read off the engine thread (as add_lora does) before the requests are added,
        so that decoding does not stall while their files are read."""
        loop = asyncio.get_running_loop()
        requests = list(requests)
        stream = OutputStream([r.request_id for r in requests], self._abort_later)
        try:
            unknown = await self._call(lambda: self._add(requests, loop, stream, defer_unknown_loras=True))
            if unknown:
                await self._add_root_loras(unknown)
                await self._call(lambda: self._add(requests, loop, stream))
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; closing or cancelling the iterator aborts the request."""
        stream = await self.add_requests([GenerationRequest(request_id, prompt, params, lora_request)])
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        """Read and validate the adapter on a worker thread, then register it on the engine thread,
        so decoding does not stall while the files are read."""
        known = await self._call(self._engine.list_loras)
        loaded = None
        if lora_request.name not in known and lora_request.path is not None:
            loaded = await asyncio.to_thread(self._engine.load_lora_weights, lora_request)
        await self._call(lambda: self._engine.add_lora(lora_request, pinned=pinned, loaded=loaded))

    async def _add_root_loras(self, names: set[str]) -> None:
        """Register adapters from the engine's lora root (none without one: add_request then answers)."""
        for name in sorted(names):
            path = await asyncio.to_thread(self._engine.lora_root_path, name)
            if path is not None:
                await self.add_lora(LoRARequest(name, path))

    async def remove_lora(self, name: str) -> None:
        await self._call(lambda: self._engine.remove_lora(name))

    async def list_loras(self) -> list[str]:
        return await self._call(self._engine.list_loras)

    async def lora_residency(self) -> dict[str, tuple[str, bool]]:
        """Every registered adapter -> (its folder, whether it is resident on the GPU now), read in one
        engine-thread call."""
        def read() -> dict[str, tuple[str, bool]]:
            manager = self._engine.lora_manager
            if manager is None:
                return {}
            on_gpu = set(self._engine.stats().loras_on_gpu)
            return {name: (manager.paths[name], name in on_gpu) for name in self._engine.list_loras()}

        return await self._call(read)

    async def stats(self) -> EngineStats:
        return await self._call(self._engine.stats)

    async def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                                  add_special_tokens: bool = False) -> list[int]:
        """Token ids of the chat prompt (by default with the assistant's generation prompt, and no special
        tokens beyond what the template writes)."""
        return await self._call(lambda: self._encode_chat(messages, add_generation_prompt, add_special_tokens))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text, as a prompt would get them."""
        def encode() -> list[int]:
            return list(self._require_tokenizer()(text, add_special_tokens=add_special_tokens)["input_ids"])

        return await self._call(encode)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids (InvalidRequestError for an id outside the vocabulary)."""
        def decode() -> str:
            tokenizer = self._require_tokenizer()
            vocab = len(tokenizer)
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            return tokenizer.decode(token_ids)

        return await self._call(decode)

    async def _call(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed or self._thread is None:
                raise EngineClosedError("the engine is not running")
            self._commands.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def _abort_later(self, request_ids: list[str]) -> None:
        with self._cond:
            if not self._closed:
                self._commands.append((lambda: self._abort(request_ids), concurrent.futures.Future()))
                self._cond.notify()

    # ---- engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # also when the loop died of an unexpected error: nobody may wait forever
            why = f"the engine stopped: {self.dead}" if self.dead is not None else "the engine stopped"
            with self._cond:
                self._closed = True
                pending, self._commands = self._commands, []
            for _, future in pending:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineClosedError(why))
            self._fail_all(EngineClosedError(why))
            if self.dead is not None and self._on_dead is not None:
                self._on_dead(self.dead)

    def _loop(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not self._commands and not busy and not self._stopping:
                    self._cond.wait()
                commands, self._commands = self._commands, []
                if not commands and not busy:  # stopping, and nothing left to do
                    return
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # handed back to the caller
                        future.set_exception(exc)
            if self._engine.has_unfinished_requests():
                self._step()
                if self.dead is not None:
                    return
            busy = self._engine.has_unfinished_requests()

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except EngineDeadError as exc:
            logger.error("the engine died: %s", exc)
            self.dead = exc
            return
        except Exception as exc:
            logger.exception("engine step failed; aborting every request in flight")
            self._fail_all(EngineStepError(f"engine step failed: {exc}"))
            return
        for output in outputs:
            rid = output.request_id
            self._not_started.discard(rid)
            route = self._routes.pop(rid, None) if output.finished else self._routes.get(rid)
            if route is not None:
                self._send(rid, route, output)

    def _send(self, request_id: str, route: tuple[asyncio.AbstractEventLoop, OutputStream],
              item: RequestOutput | BaseException) -> None:
        loop, stream = route
        try:
            loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self._abort([request_id])

    def _add(self, requests: list[GenerationRequest], loop: asyncio.AbstractEventLoop, stream: OutputStream,
             defer_unknown_loras: bool = False) -> set[str]:
        """Add the requests (all or none). With defer_unknown_loras, add nothing and return the names of
        unregistered adapters they ask for by name alone, if there are any."""
        if not self._accepting:
            raise EngineClosedError("the server is shutting down")
        if len(self._not_started) + len(requests) > self._max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self._max_waiting} requests); retry later")
        if defer_unknown_loras:
            named = {r.lora_request.name for r in requests
                     if r.lora_request is not None and r.lora_request.path is None}
            unknown = named - set(self._engine.list_loras()) if named else set()
            if unknown:
                return unknown
        added: list[str] = []
        try:
            for r in requests:
                if r.request_id in self._routes:
                    raise InvalidRequestError(f"request id {r.request_id!r} is already in use")
                self._engine.add_request(r.request_id, r.prompt, r.params, r.lora_request)
                added.append(r.request_id)
                self._routes[r.request_id] = (loop, stream)
                self._not_started.add(r.request_id)
        except Exception:
            self._abort(added)
            raise
        return set()

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._engine.abort_request(rid)
            self._routes.pop(rid, None)
            self._not_started.discard(rid)

    def _fail_all(self, error: BaseException) -> None:
        routes, self._routes = self._routes, {}
        self._not_started.clear()
        for rid, (loop, stream) in routes.items():
            try:
                self._engine.abort_request(rid)
            except Exception:
                logger.exception("aborting request %s failed", rid)
            try:
                loop.call_soon_threadsafe(stream.put, error)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _abort_all(self) -> None:
        self._fail_all(EngineClosedError("the server shut down before the request finished"))

    def _require_tokenizer(self):
        tokenizer = self._engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: it is served by token ids only")
        return tokenizer

    def _encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                     add_special_tokens: bool) -> list[int]:
        tokenizer = self._require_tokenizer()
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:  # no template, or the template rejects these messages
            raise InvalidRequestError(f"the chat template cannot format these messages: {exc}") from exc
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
