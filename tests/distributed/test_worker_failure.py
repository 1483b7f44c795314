"""A tensor-parallel engine whose worker dies: a clear error, no hang, no process left behind (CPU, gloo).

Each case runs the engine (or the server) in a subprocess with a deadline, so that a hang fails the test
instead of stalling the suite.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from loraserve import SamplingParams
from loraserve.engine.async_engine import AsyncLLMEngine, EngineClosedError
from loraserve.errors import WorkerDiedError
from loraserve.worker.processes import TensorParallelWorkers
from server_harness import free_port, wait_healthy
from tp_driver import DRIVER, REPO, alive, run_exit, run_killed_worker, spawned_children, wait_gone

DEADLINE = 180  # seconds the server may take to start before it counts as a hang


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def test_killed_worker_stops_the_engine_with_a_clear_error(model):
    """SIGKILL to worker 1 mid-generation: generate raises WorkerDiedError naming the worker and its exit code
    at once, later calls raise too, the other processes are gone and the script exits."""
    run_killed_worker(model, "cpu")


def test_script_exits_with_its_own_status(model):
    """A script that leaves its engine to the interpreter's exit ends with its own status, its workers gone."""
    run_exit(model, "cpu")


def test_sigterm_to_the_engine_process_ends_its_workers(model):
    """The engine's process ended by SIGTERM (no clean-up runs there): its workers notice and exit."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, model, "cpu", "wait"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("WORKERS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert all(alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        wait_gone(pids)
    finally:
        proc.kill()


def test_server_answers_503_and_exits_nonzero_when_a_worker_dies(model, tmp_path):
    """`loraserve serve --tensor-parallel-size 2`: a worker killed while a request streams: the request ends with
    an error, new requests get 503 while the server stops, and the process exits with status 1."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--model", model, "--device", "cpu",
         "--port", str(port), "--max-model-len", "512", "--tensor-parallel-size", "2", "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout=DEADLINE)
        (worker,) = spawned_children(proc.pid)
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 450, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(worker, signal.SIGKILL)
            rest = "\n".join(lines)
        errors = [json.loads(line[6:])["error"] for line in rest.splitlines()
                  if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[0]["type"] == "service_unavailable" and "worker 1 of 2" in errors[0]["message"], rest
        try:
            late = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": [5]}, timeout=10)
            assert late.status_code == 503
        except httpx.TransportError:
            pass  # the server had stopped listening already
        assert proc.wait(60) == 1
        log.seek(0)
        assert "tensor-parallel worker 1 of 2" in log.read()
    finally:
        proc.kill()


class _DeadEngine:
    """An engine whose next step finds its worker dead."""

    model_name, max_model_len, tokenizer = "m", 64, None

    def __init__(self):
        self.added = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.added.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.added)

    def step(self):
        raise WorkerDiedError("tensor-parallel worker 1 of 2 (pid 1) died with exit code -9")

    def abort_request(self, request_id):
        pass

    def list_loras(self):
        return []


def test_async_engine_turns_a_dead_engine_into_503s_and_tells_its_owner():
    dead = []
    engine = AsyncLLMEngine(_DeadEngine(), on_dead=dead.append)
    engine.start()

    async def run():
        with pytest.raises(EngineClosedError, match="worker 1 of 2"):
            async for _ in engine.generate("r1", [1, 2], SamplingParams(max_tokens=2)):
                pass
        for _ in range(100):
            if not engine.is_alive():
                break
            await asyncio.sleep(0.05)
        with pytest.raises(EngineClosedError):
            await engine.list_loras()

    asyncio.run(run())
    engine.shutdown()  # joins the engine thread, which tells its owner last
    assert not engine.is_alive()
    assert len(dead) == 1 and isinstance(dead[0], WorkerDiedError)


class _NeverDone:
    """A device event that never happens (rank 0's device waiting for good in a dead rank's collective)."""

    def __init__(self, after: int | None = None):
        self.queries, self.after = 0, after

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after


def test_waiting_for_a_step_ends_when_a_worker_dies():
    """Rank 0 waits for a step's results by polling: the wait returns once the event has happened, and a
    worker's death ends a wait for an event that never happens with that worker's WorkerDiedError."""
    workers = TensorParallelWorkers.__new__(TensorParallelWorkers)  # the monitor's state only: no processes
    workers._failed, workers._failure = threading.Event(), None
    done = _NeverDone(after=3)
    TensorParallelWorkers.wait_for(workers, done)
    assert done.queries == 4
    workers._failure = "tensor-parallel worker 1 of 2 (pid 7) died with exit code -9"
    threading.Timer(0.2, workers._failed.set).start()
    with pytest.raises(WorkerDiedError, match="worker 1 of 2"):
        TensorParallelWorkers.wait_for(workers, _NeverDone())
