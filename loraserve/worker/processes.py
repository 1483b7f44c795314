"""The worker processes of a tensor-parallel engine, seen from rank 0 (the engine's own process).

`TensorParallelWorkers.start` spawns one process per rank 1..N-1
(loraserve.worker.rank_process) and hosts their rendezvous; `connect` makes
rank 0's ParallelGroup. Each step goes to every worker once, as one message on
its pipe (`send`: a DeviceStep); the layers' collectives do the rest. A monitor
thread watches the processes. When one dies unexpectedly it records a
WorkerDiedError that names the rank, its exit code and its error, aborts the
group's collectives (so that rank 0 is not left waiting inside one) and ends
the other workers. Rank 0's device work runs inside `guard()`, which raises
that error instead of whatever a failed collective made of it, and rank 0
waits for a step's results with `wait_for`, which polls rather than block in
the device (a peer-to-peer all-reduce waiting for the dead rank never ends,
no abort reaches it), so the death ends that wait too; should rank 0
still be stuck in its device work DEATH_GRACE_SECONDS after a death (a
collective that could not be aborted), the monitor ends the process with the
error in the log rather than let it hang. `close` stops the workers (asked
first, then terminated, then killed).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import threading
import time

import torch
import torch.multiprocessing

from loraserve.config import EngineConfig
from loraserve.distributed import ParallelGroup, host_store
from loraserve.errors import WorkerDiedError
from loraserve.worker import rank_process
from loraserve.worker.model_runner import StepFollowers
from loraserve.worker.step_inputs import DeviceStep

logger = logging.getLogger(__name__)

DEATH_GRACE_SECONDS = 30.0  # rank 0 stuck in device work this long after a worker died: the process ends
NOTICE_SECONDS = 5.0  # how long a failed collective waits for the monitor to name the worker that died
STOP_SECONDS = 10.0  # workers asked to stop have this long before they are terminated
POLL_SECONDS = 1e-4  # how often rank 0, waiting for a step's results, looks for a dead worker


class TensorParallelWorkers(StepFollowers):
    """Ranks 1..N-1 of a tensor-parallel engine, one spawned process each; see the module docstring."""

    def __init__(self, config: EngineConfig):
        self.size = config.parallel.tensor_parallel_size
        self._custom_all_reduce = not config.parallel.disable_custom_all_reduce
        self._store = host_store(self.size)
        context = torch.multiprocessing.get_context("spawn")
        root = logging.getLogger()
        log_level = root.getEffectiveLevel() if root.handlers else None  # the workers log as this process does
        self._procs: list[multiprocessing.Process] = []
        self._commands = []  # rank 0's ends of the command pipes, rank 1 first
        self._events = {}  # the event pipe's reading end -> its rank
        for rank in range(1, self.size):
            commands_in, commands_out = context.Pipe(duplex=False)
            events_in, events_out = context.Pipe(duplex=False)
            proc = context.Process(target=rank_process.main, name=f"loraserve-tp-rank{rank}", daemon=True,
                                   args=(rank, self.size, self._store.port, config, commands_in, events_out,
                                         log_level))
            proc.start()
            commands_in.close()
            events_out.close()
            self._procs.append(proc)
            self._commands.append(commands_out)
            self._events[events_in] = rank
        self.group: ParallelGroup | None = None
        self._errors: dict[int, str] = {}  # rank -> the traceback it reported
        self._failure: str | None = None  # what the first unexpected death was
        self._failed = threading.Event()
        self._closing = threading.Event()
        self._busy = False  # rank 0 is inside guard()
        self._wake_in, self._wake_out = context.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="loraserve-tp-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def connect(self, device: torch.device) -> ParallelGroup:
        """Rank 0 joins the group (returns once every worker has joined)."""
        self.group = ParallelGroup.connect(self._store, 0, self.size, device, self._custom_all_reduce)
        return self.group

    # -- steps ---------------------------------------------------------------------------------------
    def send(self, step: DeviceStep) -> None:
        """The step to every worker (each its own copy; adapter parts in shared memory travel as handles)."""
        self.check()
        for conn in self._commands:
            try:
                conn.send(step)
            except OSError as exc:
                self._failed.wait(NOTICE_SECONDS)
                self.check()
                raise WorkerDiedError("a tensor-parallel worker stopped taking steps") from exc

    @property
    def failure(self) -> str | None:
        """What ended a dead worker (rank, pid, exit code, its traceback), or None while all live."""
        return self._failure

    def check(self) -> None:
        """Raise WorkerDiedError if a worker died."""
        if self._failure is not None:
            raise WorkerDiedError(self._failure)

    def wait_for(self, event: torch.cuda.Event) -> None:
        """Wait until `event` (a step's results on their way to rank 0's host) has happened, or raise
        WorkerDiedError once a worker has died."""
        while not event.query():
            if self._failed.wait(POLL_SECONDS):
                raise WorkerDiedError(self._failure)

    @contextlib.contextmanager
    def guard(self):
        """Around rank 0's device work (start-up, each step): an error there after a worker died becomes
        that worker's WorkerDiedError, and results read after a death are not trusted (raises then too)."""
        self.check()
        self._busy = True
        try:
            yield
        except Exception as exc:
            if self._failed.wait(NOTICE_SECONDS):
                raise WorkerDiedError(self._failure) from exc
            raise
        finally:
            self._busy = False
        self.check()

    # -- the monitor ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        events = dict(self._events)
        while True:
            ready = multiprocessing.connection.wait([self._wake_in, *events, *sentinels])
            if self._wake_in in ready or self._closing.is_set():
                return
            for conn in [c for c in ready if c in events]:
                self._read_event(conn, events)
            dead = [sentinels.pop(s) for s in ready if s in sentinels]
            if dead:
                for conn in [c for c, rank in events.items() if rank in dead]:  # its last words, if any
                    self._read_event(conn, events)
                self._fail(min(dead))
                self._end_if_stuck()
                return

    def _read_event(self, conn, events: dict) -> None:
        rank = events[conn]
        try:
            while conn.poll():
                self._errors[rank] = conn.recv()
        except (EOFError, OSError):
            del events[conn]

    def _fail(self, rank: int) -> None:
        proc = self._procs[rank - 1]
        proc.join(1.0)
        error = self._errors.get(rank)
        detail = f":\n{error.rstrip()}" if error else " (killed, or it crashed without a Python error)"
        self._failure = (f"tensor-parallel worker {rank} of {self.size} (pid {proc.pid}) died with exit code "
                         f"{proc.exitcode}{detail}")
        logger.error("%s; the engine stops", self._failure)
        self._failed.set()
        if self.group is not None:
            self.group.abort()
        for other in self._procs:
            if other.is_alive():
                other.terminate()

    def _end_if_stuck(self) -> None:
        """Rank 0's device work may wait forever for the dead rank: end the process if it does."""
        died = time.monotonic()
        while not self._closing.wait(0.5):
            if self._busy and time.monotonic() - died > DEATH_GRACE_SECONDS:
                logger.critical("%s; rank 0 is still stuck in its device work %.0f s later: exiting",
                                self._failure, DEATH_GRACE_SECONDS)
                os._exit(1)

    # -- the end -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers: asked to (they leave the group), then terminated, then killed; then rank 0 leaves
        the group. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        with contextlib.suppress(OSError):
            self._wake_out.send(None)
        for conn in self._commands:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + STOP_SECONDS
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.group is not None:
            self.group.close()
        for conn in [*self._commands, *self._events, self._wake_in, self._wake_out]:
            conn.close()
        self._monitor.join(5.0)
