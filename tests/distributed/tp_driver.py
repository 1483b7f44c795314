"""A script that runs a tensor-parallel engine of 2 ranks in its own process (so that a test can kill a worker
or the script itself under a deadline), and the checks on its processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE = 240  # seconds the script may take, start-up included, before it counts as a hang

DRIVER = """
import os, signal, sys, threading, time
from loraserve import LLM, SamplingParams

if __name__ == "__main__":
    model, device, action = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = LLM(model, device=device, max_model_len=512, max_num_seqs=8, tensor_parallel_size=2)
    pids = llm.engine.workers.pids
    print("WORKERS", *pids, flush=True)
    if action == "wait":  # the test signals this process
        time.sleep(600)
    if action == "exit":  # the engine left to the interpreter's exit
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, SamplingParams(max_tokens=40, ignore_eos=True),
                           use_tqdm=False)
        print("GENERATED", sum(len(o.outputs[0].token_ids) for o in out), flush=True)
        sys.exit(3)
    threading.Timer(1.0, lambda: os.kill(pids[0], signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        while time.monotonic() < start + 60:  # generating when the worker is killed
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, SamplingParams(max_tokens=450, ignore_eos=True),
                         use_tqdm=False)
    except Exception as exc:
        print("RAISED", type(exc).__name__, round(time.monotonic() - start, 1), str(exc).replace(chr(10), " "),
              flush=True)
        try:
            llm.generate([{"prompt_token_ids": [5]}], use_tqdm=False)
        except Exception as again:
            print("AGAIN", type(again).__name__, flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)
"""


def worker_pids(out: str) -> list[int]:
    """The worker pids the script printed (its WORKERS line)."""
    return [int(p) for p in next(line for line in out.splitlines() if line.startswith("WORKERS")).split()[1:]]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "worker processes outlived the engine"


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing workers among the children of `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == pid and "spawn_main" in cmdline:
            found.append(int(entry))
    return found


def run_killed_worker(model: str, device: str) -> None:
    """Run the script with worker 1 killed mid-generation: WorkerDiedError naming it within a minute, again on
    the next call, the script exits and no worker outlives it."""
    proc = subprocess.run([sys.executable, "-c", DRIVER, model, device, "kill"], cwd=REPO, capture_output=True,
                          text=True, timeout=DEADLINE)
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr
    pids = worker_pids(out)
    _, kind, seconds, message = next(line for line in out.splitlines() if line.startswith("RAISED")).split(" ", 3)
    assert kind == "WorkerDiedError"
    assert f"tensor-parallel worker 1 of 2 (pid {pids[0]}) died with exit code -9" in message
    assert float(seconds) < 60
    assert "AGAIN WorkerDiedError" in out
    wait_gone(pids)


def run_exit(model: str, device: str) -> None:
    """Run the script to its own exit without shutting the engine down: its exit status is the script's,
    rank 0 leaves its group at once (no abort given up on) and no worker outlives it."""
    proc = subprocess.run([sys.executable, "-c", DRIVER, model, device, "exit"], cwd=REPO, capture_output=True,
                          text=True, timeout=DEADLINE)
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr
    assert "GENERATED 160" in out
    assert "left behind" not in proc.stderr, proc.stderr
    wait_gone(worker_pids(out))
