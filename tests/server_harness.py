"""Helpers for the server tests: run an app with uvicorn on a free 127.0.0.1 port in a thread, wait for a
server process to answer /health, read and parse /metrics.

Only serve() needs the server's packages (fastapi, uvicorn) and imports them itself, so that tests of
`loraserve serve` in a subprocess can use the other helpers where those packages are not installed.
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraserve.engine.async_engine import AsyncLLMEngine

if TYPE_CHECKING:
    from loraserve.entrypoints.server import ServerSettings


@contextlib.contextmanager
def serve(engine: AsyncLLMEngine, settings: ServerSettings) -> Iterator[str]:
    """Serve build_app(engine, settings) on 127.0.0.1 (port chosen by the OS); yields the base URL."""
    import uvicorn

    from loraserve.entrypoints.server import build_app

    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def free_port() -> int:
    """A 127.0.0.1 port free now (for a server started in a subprocess with --port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll {url}/health until it answers 200; fails if `proc` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited early"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError("the server did not become healthy")


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition as {(name, sorted label pairs): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def read_metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, as parse_metrics gives them."""
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    return parse_metrics(response.text)


def metric(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as for a label set that was never touched)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until_idle(base_url: str, timeout: float = 30.0) -> dict:
    """Poll /metrics until no request runs or waits and no KV block is used; returns the last samples."""
    deadline = time.monotonic() + timeout
    while True:
        samples = read_metrics(base_url)
        busy = (metric(samples, "loraserve_num_requests_running") + metric(samples, "loraserve_num_requests_waiting")
                + metric(samples, "loraserve_kv_cache_blocks_used"))
        if busy == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)
