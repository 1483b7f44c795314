"""`loraserve serve`: its command-line flags and the function that runs the server.

SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight
finish, stops the engine thread (and a tensor-parallel engine's workers) and
returns. An engine that dies (a tensor-parallel worker died) answers 503 to
the requests in flight and to new ones while the server stops, and the
process exits with status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket

from loraserve.config import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.engine.engine import LLMEngine
from loraserve.entrypoints.engine_flags import add_engine_flags, engine_args
from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def parse_lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def json_string_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's CORS flags take them: '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return tuple(value)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `loraserve serve` (named as in vLLM where vLLM has them)."""
    add_engine_flags(parser)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names the base model answers to; the first is listed "
                             "(default: the model's name and the --model value)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LORASERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $LORASERVE_API_KEY)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests that may wait for their first token before new ones get 503")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve adapters (implied by --lora-modules, --lora-root and "
                             "--enable-runtime-lora-updates)")
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[], metavar="NAME=PATH",
                        help="adapters to register at start")
    parser.add_argument("--enable-runtime-lora-updates", action="store_true",
                        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    parser.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                        help="a folder of adapters: a request whose model names a folder in the first DIR is "
                             "served from it without loading it first; runtime-loaded adapter paths must "
                             "resolve inside a DIR (repeatable)")
    parser.add_argument("--allowed-origins", type=json_string_list, default=("*",),
                        help='CORS: origins browsers may call from, a JSON list (default ["*"])')
    parser.add_argument("--allowed-methods", type=json_string_list, default=("*",),
                        help='CORS: allowed methods, a JSON list (default ["*"])')
    parser.add_argument("--allowed-headers", type=json_string_list, default=("*",),
                        help='CORS: allowed request headers, a JSON list (default ["*"])')
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def serve_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine options of parsed `loraserve serve` flags: LoRA is on with any adapter flag, and requests
    may name the adapter folders of the first --lora-root."""
    enable_lora = bool(args.enable_lora or args.lora_modules or args.lora_root or args.enable_runtime_lora_updates)
    return dataclasses.replace(engine_args(args, enable_lora), lora_root=args.lora_root[0] if args.lora_root else None)


def run_server(args: argparse.Namespace) -> None:
    """Build the engine, register --lora-modules, serve until SIGTERM/SIGINT, then drain and stop."""
    import uvicorn

    from loraserve.entrypoints.server import ServerSettings, build_app  # needs fastapi, which `generate` does not

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.enable_runtime_lora_updates and not args.lora_root:
        raise SystemExit("--enable-runtime-lora-updates needs --lora-root DIR")
    check_address_free(args.host, args.port)  # before the model loads, which can take minutes
    engine = LLMEngine.from_args(serve_engine_args(args))
    modules = tuple((name, os.path.realpath(path)) for name, path in args.lora_modules)
    for name, path in modules:
        try:
            engine.add_lora(LoRARequest(name, path))
        except ValueError as exc:
            raise SystemExit(f"--lora-modules {name}={path}: {exc}") from exc
    names = args.served_model_name or [engine.model_name] + ([args.model] if args.model else [])
    settings = ServerSettings(
        served_model_names=tuple(dict.fromkeys(names)), api_key=args.api_key,
        enable_runtime_lora_updates=args.enable_runtime_lora_updates, lora_roots=tuple(args.lora_root),
        lora_modules=modules, allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    server = None

    def stop_serving(exc: BaseException) -> None:  # the engine died: the server stops, the process fails
        logger.error("stopping the server: %s", exc)
        if server is not None:
            server.should_exit = True

    async_engine = AsyncLLMEngine(engine, max_waiting_requests=args.max_waiting_requests, on_dead=stop_serving)
    app = build_app(async_engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    # uvicorn handles SIGTERM/SIGINT itself: it closes the listening socket and waits for the open
    # requests. Afterwards it raises the signal again for the handler it found; these quiet handlers
    # make that a normal return, so the engine is shut down and the process exits with status 0.
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    async_engine.start()
    try:
        server.run()
    finally:
        async_engine.shutdown(drain=True)
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("server and engine stopped")
    if async_engine.dead is not None:
        raise SystemExit(f"error: {async_engine.dead}")


def check_address_free(host: str, port: int) -> None:
    """Exit with a clear message if (host, port) can't be listened on now (another server holds it)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a listener still blocks it
            sock.bind((host, port))
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc.strerror or exc} "
                         "(is another server using it? pick another --port)") from exc


def _ignore_signal(signum, frame) -> None:
    logger.info("signal %d: the server has already drained and stopped", signum)
