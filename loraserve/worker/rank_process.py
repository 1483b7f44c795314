"""What runs in the worker process of rank r > 0 of a tensor-parallel engine.

It joins rank 0's group, loads its part of the model, builds its ModelRunner
(the same start-up as rank 0's, in step with it), then follows the steps rank 0
sends (`ModelRunner.follow`) until it is told to stop (None), its command pipe
closes, or rank 0's process goes away (then it exits at once, wherever it is:
a collective waiting for rank 0 would never end). Ctrl-C is rank 0's to
handle; SIGTERM ends the process. An error is reported to rank 0 before the
process exits non-zero. The process ends without the interpreter's finalization
(os._exit, after flushing its output) and without leaving its group first: at
the end a collective backend has nothing left to do but release what the
process's end releases anyway, and NCCL's abort (the only way out of a group
that never waits) returned only seconds later, by then inside the
interpreter's finalization, which ended the process with SIGABRT.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback
from dataclasses import replace

import torch

from loraserve.config import EngineConfig
from loraserve.distributed import ParallelGroup, join_store
from loraserve.models.loader import open_model
from loraserve.worker.model_runner import ModelRunner


def main(rank: int, size: int, store_port: int, config: EngineConfig, commands, events,
         log_level: int | None = None) -> None:
    """The process's entry (spawned): commands: the pipe DeviceSteps arrive on; events: where errors go;
    log_level: rank 0's logging level where it configured logging (its records then carry the rank)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_level is not None:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s")
    _exit_with_parent()
    status = 0
    try:
        device = config.parallel.device_of(config.model.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        config = replace(config, model=replace(config.model, device=device))
        tp = ParallelGroup.connect(join_store(store_port, size), rank, size, device,
                                   not config.parallel.disable_custom_all_reduce)
        model = open_model(config.model.model).load_model(device, config.model.dtype, tp)
        runner = ModelRunner.build(model, config, None, tp=tp)
        while True:
            try:
                step = commands.recv()
            except EOFError:  # rank 0 closed the pipe (or is gone)
                break
            if step is None:
                break
            runner.follow(step)
    except BaseException:
        status = 1
        error = traceback.format_exc()
        sys.stderr.write(error)
        try:
            events.send(error)
        except OSError:
            pass
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _exit_with_parent() -> None:
    """End this process as soon as rank 0's process ends, even inside a collective that waits for it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="loraserve-parent-watch", daemon=True).start()
