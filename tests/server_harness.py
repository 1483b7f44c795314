"""Helpers for the server tests: run an app with uvicorn on a free 127.0.0.1 port in a thread, read /metrics."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.entrypoints.server import ServerSettings, build_app


@contextlib.contextmanager
def serve(engine: AsyncLLMEngine, settings: ServerSettings) -> Iterator[str]:
    """Serve build_app(engine, settings) on 127.0.0.1 (port chosen by the OS); yields the base URL."""
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


def read_metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted label pairs): value}."""
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


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
