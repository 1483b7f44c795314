"""Reading adapter folders into packed host memory, off the engine's interpreter where it can.

`read(name, path)` reads a PEFT folder, checks it (lora/adapter.py: every check, with its message) and packs it
in page layout (lora/pool.py's AdapterPacker); the result, a LoadedAdapter, is ready to copy into the GPU pool.
Two readers do that, with the same results and the same errors:

- ThreadReader: the calling thread does it all. Most of that work is Python holding the interpreter lock
  (hundreds of tensors to check and place), which the engine thread then waits for between its own calls.
- ProcessReader: a reader process does it. Where the host arena (CUDA: lora/host_arena.py) is a shared-memory
  file, the reader process maps it too: once it has checked an adapter, this process gives it a range of the
  arena and it packs the adapter straight into it (nothing is copied here). Otherwise (no arena, or no room in
  it) it packs into an anonymous shared-memory file (memfd) and hands the file's descriptor back over a socket;
  this process maps it and copies it into the arena where it has one (one bulk copy, the interpreter lock
  free meanwhile). The copy to the GPU stays with the caller. A LoRAAdapterError comes back as the same error, and the reader's log records are logged here.

A reader process is a plain `python -c` child of this interpreter, never multiprocessing's spawn (which would
import the user's main script again). The ProcessReader keeps `processes` of them, so that reads from several
threads run side by side; they start with the ProcessReader (in the background: a first read waits for its process
to be ready). Each reads one adapter at a time, and exits when its socket closes: at `close()`, when the reader is
collected, at exit, or when this process dies. A reader process that dies during a read is started again and the
read tried once more; one that dies again, can't start, or takes longer than READ_TIMEOUT_S fails that read with
AdapterReaderError (a LoRAAdapterError naming the adapter), and the next read in its place starts a new one.

Both place what they read in the host arena when they are given one. `make_reader` picks one: "auto" is the
process reader where there is a host arena (CUDA) and the platform has
memfd (Linux), else the thread reader (a CPU engine's steps share the cores with the reader either way).
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import torch

from loraserve.lora.adapter import LoRAAdapterError, load_lora_adapter
from loraserve.lora.host_arena import HostArena
from loraserve.lora.pool import AdapterPacker, PackedAdapter
from loraserve.models.lora_spec import LoRAModelSpec

logger = logging.getLogger(__name__)

READER_KINDS = ("auto", "process", "thread")
READ_TIMEOUT_S = 300.0  # a read that takes longer fails, and its reader process is stopped
START_TIMEOUT_S = 120.0  # a reader process must be ready (torch imported) within this
# The reader process works with one torch thread at a lower priority, so that where cores are short it yields them
# to the engine (on a loaded 2-core machine, two threads at the engine's priority made the engine's steps slower
# and the reads themselves 5x slower: benchmarks/adapter_reads.py).
READER_THREADS = 1
READER_NICENESS = 10
_POLL_S = 0.5  # how often a waiting read checks that the reader process is alive
# shared-memory files are mapped with their pages at once (MAP_POPULATE, Linux): an adapter's tens of thousands of
# page faults on first touch took longer than its copy
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class ReadPhases:
    """Where a read's seconds went."""

    files: float  # reading and checking the adapter's files
    range_wait: float  # the reader process waiting for a range of the host arena (0 for the thread reader)
    pack: float  # packing in page layout (zeroing an arena range first; the thread reader: placing it in the arena)


@dataclass
class LoadedAdapter:
    """An adapter read, validated and packed on the host."""

    packed: PackedAdapter
    rank: int
    seconds: float  # reading, checking and packing it
    version: tuple | None = None  # what was read: the files' version (LoRAManager.load), None when unknown
    phases: ReadPhases | None = None  # None: packed from an adapter in memory (nothing read)


@dataclass(frozen=True)
class ReaderSetup:
    """What reading needs besides the folder: the model's LoRA shapes, the rank limit and the page layout."""

    spec: LoRAModelSpec
    max_lora_rank: int
    packer: AdapterPacker


class AdapterReaderError(LoRAAdapterError):
    """The reader process failed (died, did not start, timed out) while reading an adapter: the adapter's
    requests fail, the engine goes on, and the next read starts a new reader process."""


class ThreadReader:
    """Reads on the calling thread (any thread)."""

    def __init__(self, setup: ReaderSetup, host: HostArena | None):
        self.setup, self.host = setup, host

    def read(self, name: str, path: str) -> LoadedAdapter:
        start = time.perf_counter()
        adapter = load_lora_adapter(name, path, self.setup.spec, self.setup.max_lora_rank)
        read = time.perf_counter()
        packed = self.setup.packer.pack(adapter)
        if self.host is not None:
            packed = self.host.hold(packed)
        end = time.perf_counter()
        return LoadedAdapter(packed, adapter.max_rank, end - start, phases=ReadPhases(read - start, 0.0, end - read))

    def close(self) -> None:
        pass


class _ReaderFailed(Exception):
    """The reader process died, did not start or timed out (the reason in the message); `retry`: whether a new
    reader process may try the read again."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


class _Child:
    """One reader process and this side of its socket."""

    def __init__(self, setup: ReaderSetup, arena: HostArena | None):
        ours, theirs = socket.socketpair()
        arena_fds = [arena.fd] if arena is not None else []  # the child maps the shared arena by its descriptor
        # the same loraserve as this process's, found first (a source checkout need not be on PYTHONPATH)
        code = (f"import sys; sys.path[:0] = [p for p in [{_PACKAGE_ROOT!r}] if p not in sys.path]; "
                f"from loraserve.lora.reader import serve; serve({theirs.fileno()})")
        try:
            # its own session: a Ctrl-C at the terminal reaches the engine, which then closes the socket
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno(), *arena_fds],
                                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # it never uses a GPU
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            ours.close()
            raise _ReaderFailed(f"the adapter reader process can't be started ({exc})", retry=False) from None
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        try:
            self.conn.send((setup, arena.fd, arena.nbytes) if arena is not None else (setup, None, 0))
        except OSError:
            pass  # it exited already: waiting for it to be ready says how

    def close(self) -> None:
        """Close the socket (the reader exits when it sees that); kill it if it has not exited a second later."""
        self.conn.close()
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _close_all(children: list[_Child]) -> None:
    while children:
        children.pop().close()


class _Slot:
    """One reader process's place: the live process, if any (a list, so that the finalizer closes what is
    there when it runs), and the lock held while it reads."""

    def __init__(self):
        self.children: list[_Child] = []
        self.lock = threading.Lock()


def _close_slots(slots: list[_Slot]) -> None:
    for slot in slots:
        _close_all(slot.children)


class ProcessReader:
    """Reads in up to `processes` reader processes at once (see the module docstring); `read` may be called from
    any thread, and reads from several threads run side by side, one per reader process."""

    def __init__(self, setup: ReaderSetup, host: HostArena | None, processes: int = 1):
        if processes < 1:
            raise ValueError(f"a process reader needs at least one process, got {processes}")
        self.setup, self.host = setup, host
        self._slots = [_Slot() for _ in range(processes)]
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for slot in self._slots:
            self._free.put(slot)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_slots, self._slots)
        self._arena = host if host is not None and host.fd is not None else None  # shared with the processes
        for slot in self._slots:
            try:
                slot.children.append(_Child(setup, self._arena))  # ready by the first read, in most cases
            except _ReaderFailed as exc:
                logger.warning("%s; the first adapter read in its place tries again", exc)
                break

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The live reader processes."""
        return [child.proc for slot in self._slots for child in slot.children]

    @property
    def pid(self) -> int | None:
        """The first reader process's id (None while none runs)."""
        return self.processes[0].pid if self.processes else None

    def read(self, name: str, path: str) -> LoadedAdapter:
        slot = self._free.get()  # a reader process of our own for this read
        try:
            with slot.lock:
                for attempt in (1, 2):
                    try:
                        return self._read(slot, name, path)
                    except _ReaderFailed as exc:
                        _close_all(slot.children)
                        if attempt == 2 or not exc.retry:
                            raise AdapterReaderError(name, f"can't be read: {exc}") from None
                        logger.warning("LoRA adapter '%s': %s; reading it again in a new reader process", name, exc)
        finally:
            self._free.put(slot)
        raise AssertionError("unreachable")

    def _child(self, slot: _Slot) -> _Child:
        if self._closed:
            raise _ReaderFailed("the adapter reader is closed", retry=False)
        if not slot.children:
            slot.children.append(_Child(self.setup, self._arena))
        child = slot.children[0]
        if not child.ready:
            reply = self._reply(child, START_TIMEOUT_S, "starting")
            if reply != ("ready",):
                raise _ReaderFailed(f"the adapter reader process answered {reply!r} when it started", retry=False)
            child.ready = True
        return child

    def _read(self, slot: _Slot, name: str, path: str) -> LoadedAdapter:
        child = self._child(slot)
        try:
            child.conn.send((name, path))
        except OSError as exc:
            raise _ReaderFailed(f"the adapter reader process is gone ({exc})") from None
        reply = self._reply(child, READ_TIMEOUT_S, "reading it")
        taken = None  # (data, ranks) of the arena range it packs into
        try:
            if reply[0] == "shape":  # checked: a range of the shared arena to pack into, if one is free
                taken = self._arena.take_packed(reply[1], self.setup.packer.dtype, len(self.setup.packer.layers))
                try:
                    child.conn.send(("arena", self._arena.offset_of(taken[0])) if taken else ("own",))
                except OSError as exc:
                    raise _ReaderFailed(f"the adapter reader process is gone ({exc})") from None
                reply = self._reply(child, READ_TIMEOUT_S, "packing it")
            loaded = self._loaded(child, name, reply, taken)
        except BaseException as exc:
            if taken is not None:
                if not isinstance(exc, LoRAAdapterError):  # it may still be packing: gone before its range is reused
                    _close_all(slot.children)
                self._arena.give_back(taken[0])
            raise
        return loaded

    def _loaded(self, child: _Child, name: str, reply: tuple,
                taken: tuple[torch.Tensor, torch.Tensor] | None) -> LoadedAdapter:
        """The adapter of the reader process's final `reply` (or its error), packed into `taken` or sent in a
        shared-memory file."""
        kind, records = reply[0], reply[-1]
        for level, logger_name, message in records:
            logging.getLogger(logger_name).log(level, "%s", message)
        if kind == "adapter_error":
            _, adapter, problem, module, _ = reply
            raise LoRAAdapterError(adapter, problem, module)
        if kind == "failed":
            raise AdapterReaderError(name, f"can't be read: the adapter reader failed ({reply[1]})")
        _, shape, row_blocks, ranks, rank, seconds, phases, _ = reply
        if taken is not None:
            data, ranks_in_arena = taken
            ranks_in_arena.copy_(torch.tensor(ranks, dtype=torch.int32))
            return LoadedAdapter(PackedAdapter(data, tuple(row_blocks), ranks_in_arena), rank, seconds,
                                 phases=ReadPhases(*phases))
        try:
            fd = recv_handle(child.conn)
        except (EOFError, OSError) as exc:
            raise _ReaderFailed(f"the adapter reader process died sending its pages ({exc})") from None
        packed = PackedAdapter(_map_shared(fd, shape, self.setup.packer.dtype), tuple(row_blocks),
                               torch.tensor(ranks, dtype=torch.int32))
        if self.host is not None:
            packed = self.host.hold(packed)  # one bulk copy
        return LoadedAdapter(packed, rank, seconds, phases=ReadPhases(*phases))

    @staticmethod
    def _reply(child: _Child, timeout: float, doing: str):
        """The reader process's next message; _ReaderFailed when it dies or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while not child.conn.poll(_POLL_S):
            code = child.proc.poll()
            if code is not None:
                raise _ReaderFailed(f"the adapter reader process exited ({_exit_status(code)}) while {doing}")
            if time.monotonic() > deadline:
                raise _ReaderFailed(f"the adapter reader process took over {timeout:.0f} s {doing} and was stopped",
                                    retry=False)
        try:
            return child.conn.recv()
        except (EOFError, OSError):  # its end of the socket closed: it exited, or is about to
            try:
                status = _exit_status(child.proc.wait(timeout=5.0))
            except subprocess.TimeoutExpired:
                status = "its socket closed"
            raise _ReaderFailed(f"the adapter reader process exited ({status}) while {doing}") from None

    def close(self) -> None:
        """Stop the reader processes: each exits when its socket closes; a read in progress fails with
        AdapterReaderError (its reader process is killed first)."""
        self._closed = True
        for slot in self._slots:  # every slot held: no read is left running
            if not slot.lock.acquire(blocking=False):
                for child in list(slot.children):
                    child.proc.kill()
                slot.lock.acquire()
        try:
            self._finalizer()
        finally:
            for slot in self._slots:
                slot.lock.release()


def _exit_status(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _map_shared(fd: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A [pages, width] tensor over the shared-memory file `fd` (mapped; `fd` is closed)."""
    try:
        numel = shape[0] * shape[1]
        mapped = mmap.mmap(fd, numel * dtype.itemsize, flags=_MAP_FLAGS)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=dtype, count=numel).view(shape)


def make_reader(kind: str, setup: ReaderSetup, host: HostArena | None,
                processes: int = 1) -> ThreadReader | ProcessReader:
    """The reader of `kind` (READER_KINDS; see the module docstring for "auto"); a process reader keeps up to
    `processes` reader processes (a thread reader reads on as many threads as call it)."""
    if kind not in READER_KINDS:
        raise ValueError(f"lora reader must be one of {', '.join(READER_KINDS)}, got {kind!r}")
    can_fork_reader = hasattr(os, "memfd_create")
    if kind == "process" and not can_fork_reader:
        raise ValueError("the process adapter reader needs memfd_create (Linux); use the thread reader")
    if kind == "process" or (kind == "auto" and host is not None and can_fork_reader):
        return ProcessReader(setup, host, processes)
    return ThreadReader(setup, host)


# -- the reader process ----------------------------------------------------------------------------------


class _Records(logging.Handler):
    """Keeps the log records of one read, to be logged again by the engine's process."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.name, record.getMessage()))


def _shared_zeros(shape: tuple[int, int], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """A new anonymous shared-memory file of a [pages, width] tensor (zeros) and the tensor mapped over it."""
    fd = os.memfd_create("loraserve-adapter", os.MFD_CLOEXEC)
    numel = shape[0] * shape[1]
    nbytes = numel * dtype.itemsize
    os.ftruncate(fd, nbytes)  # a new file reads as zeros
    return fd, torch.frombuffer(mmap.mmap(fd, nbytes, flags=_MAP_FLAGS), dtype=dtype, count=numel).view(shape)


def serve(fd: int) -> None:
    """The reader process: read the setup from socket `fd`, then answer (name, path) jobs until it closes."""
    conn = Connection(fd)
    try:
        setup, arena_fd, arena_bytes = conn.recv()
        arena = None  # [bytes] the engine's shared host arena, mapped here
        if arena_fd is not None:
            # populated (_MAP_FLAGS): faulting in each range on first touch made a rank-16 read 67 ms, not 45
            arena = torch.frombuffer(mmap.mmap(arena_fd, arena_bytes, flags=_MAP_FLAGS), dtype=torch.uint8)
        torch.set_num_threads(READER_THREADS)
        os.nice(READER_NICENESS)
        collected = _Records()
        package_logger = logging.getLogger("loraserve")
        package_logger.addHandler(collected)
        package_logger.setLevel(logging.INFO)
        package_logger.propagate = False
        conn.send(("ready",))
        while True:
            name, path = conn.recv()
            collected.records = []
            _answer(conn, setup, arena, name, path, collected.records)
    except (EOFError, OSError):  # the engine closed the socket, or is gone
        return


def _answer(conn: Connection, setup: ReaderSetup, arena: torch.Tensor | None, name: str, path: str,
            records: list) -> None:
    """Read, check and pack one adapter into the range of the shared `arena` the engine's process gives (or into
    a shared-memory file) and send it (or the error) back."""
    start = time.perf_counter()
    shared = None
    try:
        adapter = load_lora_adapter(name, path, setup.spec, setup.max_lora_rank)
        shape = setup.packer.shape_of(adapter)
        read = time.perf_counter()
        where = ("own",)
        if arena is not None:
            conn.send(("shape", shape))
            where = conn.recv()  # ("arena", offset) or ("own",)
        given = time.perf_counter()
        if where[0] == "arena":
            nbytes = math.prod(shape) * setup.packer.dtype.itemsize
            data = arena[where[1]:where[1] + nbytes].view(setup.packer.dtype).view(shape)
            data.zero_()  # a range used before
        else:
            shared, data = _shared_zeros(shape, setup.packer.dtype)
        packed = setup.packer.pack(adapter, data)
        end = time.perf_counter()
        reply = ("packed", shape, packed.row_blocks, packed.ranks.tolist(), adapter.max_rank, end - start,
                 (read - start, given - read, end - given), records)
        del adapter, packed, data  # unmapped here: a shared file stays until the engine's process has it
    except LoRAAdapterError as exc:
        reply = ("adapter_error", exc.adapter, exc.problem, exc.module, records)
    except Exception as exc:  # noqa: BLE001 (any other failure fails this read, not the reader)
        reply = ("failed", f"{type(exc).__name__}: {exc}", records)
    try:
        conn.send(reply)
        if reply[0] == "packed" and shared is not None:
            send_handle(conn, shared, os.getppid())
    finally:
        if shared is not None:
            os.close(shared)
