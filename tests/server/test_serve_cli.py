"""`loraserve serve` in a subprocess (flags, --lora-modules, SIGTERM drain) and the server on the default model."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from model_fixtures import make_lora_adapters
from server_harness import free_port, serve, wait_healthy

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.entrypoints.server import ServerSettings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait_refused(port: int, timeout: float = 10.0) -> float:
    """Poll until the listening socket is closed; returns the time it was first seen closed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError("the server kept accepting connections after SIGTERM")


def test_sigterm_drains_in_flight_requests_and_exits(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    (adapter,) = make_lora_adapters(model, tmp_path, [dict(name="ad", r=4, target_modules=["q_proj"])])
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--model", model, "--device", "cpu",
         "--port", str(port), "--max-model-len", "256", "--lora-modules", f"ad={adapter}", "--api-key", "k",
         "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=150)
        body = {"model": "ad", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        arrivals: list[tuple[float, str]] = []  # (time, line), read as soon as each chunk arrives
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k"},
                          timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            reader = threading.Thread(target=lambda: arrivals.extend((time.monotonic(), x) for x in lines if x))
            reader.start()
            proc.send_signal(signal.SIGTERM)
            refused_at = _wait_refused(port)
            reader.join(120)
        assert arrivals[-1][1] == "data: [DONE]"
        assert json.loads(arrivals[-2][1][len("data: "):])["usage"]["completion_tokens"] == 200
        assert arrivals[-1][0] > refused_at  # the request was still generating while the server shut down
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        print((tmp_path / "server.log").read_text())  # shown by pytest when the test fails


@pytest.mark.slow
def test_default_model_chat():
    from loraserve.config import EngineArgs
    from loraserve.engine.engine import LLMEngine
    from loraserve.models.gguf_loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))

    engine = AsyncLLMEngine(LLMEngine.from_args(EngineArgs(device="cpu", max_model_len=512, max_num_seqs=4)))
    engine.start()
    try:
        with serve(engine, ServerSettings()) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            (model,) = [m.id for m in client.models.list().data]
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=12, temperature=0)
            assert "Paris" in answer.choices[0].message.content
            assert answer.usage.completion_tokens <= 12
    finally:
        engine.shutdown(drain=False)


def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--model", "/nonexistent/model",
             "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr  # not the missing model: it was never read
    assert "/nonexistent/model" not in proc.stderr and time.monotonic() - start < 60


def test_version_flag():
    proc = subprocess.run([sys.executable, "-m", "loraserve.entrypoints.cli", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("loraserve ") and proc.stdout.split()[1][0].isdigit()
