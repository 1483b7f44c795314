"""Adapter manager: which adapters are known, cached in host memory and resident in the GPU pool.

- registry: name -> source (a PEFT folder, or an adapter object given in memory); registering validates
  the adapter at once and records its rank (so the scheduler knows its pages before it is loaded).
- host cache: adapters packed in page layout (on CUDA in the runtime's host arena, pinned once at start-up:
  lora/host_arena.py), least recently used out when their bytes exceed max_cpu_lora_memory (or their number
  max_cpu_loras): first those that no waiting request needs before they are in the pool, then the others.
  Folder adapters are read again when needed; in-memory ones are packed again from their object. Pinned
  adapters stay.
- GPU pool (lora/pool.py): an adapter a step needs is loaded into free pages, evicting the least recently
  used adapters with no request in flight, never a pinned one. Loads are copies on the runtime's load
  stream; the first step that uses an adapter waits for its copy on the device, never on the host.
- reading (lora/reader.py): adapter folders are read, checked and packed by the reader, in reader processes
  on CUDA (the engine's interpreter stays free for the steps), called from worker threads here (up to
  `read_workers()` reads side by side with reader processes, one with the thread reader, whose reads hold the
  interpreter lock) or from the caller's thread (`load`). With reader processes READ_QUEUE_FACTOR reads per
  process are started, one running and the others queued behind it, so that a worker that finishes a read
  starts the next at once rather than at the next step (steps and reads take tens of milliseconds each).
  `close()` stops both.
- load-ahead (`prefetch`): the adapters of waiting requests are read from disk on the worker threads and
  copied into the pool while earlier steps run, as far as room allows without evicting an adapter that a
  running or waiting request needs. Reads start only while the host cache has room for them beside the
  adapters already read for waiting requests, so that nothing read ahead pushes out what waits to be used.
- readiness (`is_ready`): an adapter in the pool or the host cache can be made resident at once; the
  scheduler admits a request of another adapter only when its read is done, so no step waits for a read.
- identity (`identity`): a number given to each registration, and again whenever the adapter's files are
  read in another version than before (`files_version`), never the name; the prefix cache keys K/V blocks by
  it, so weights that may differ never share cached blocks.
- registration in the background (`start_register`, `collect_registrations`): a folder read on a worker
  thread and registered when its read is done, for callers that must not wait for it; such reads queue, first
  come first served, and start under the same room rule as the load-ahead's.
- refcounts: requests in flight per adapter. An unregistered adapter refuses new requests; its in-flight
  requests finish with the weights already loaded.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from loraserve.config import LoRAConfig
from loraserve.errors import InvalidRequestError, LoRAConflictError, UnknownLoRAError
from loraserve.lora.adapter import LoRAAdapter, LoRAAdapterError
from loraserve.lora.pool import PackedAdapter
from loraserve.lora.reader import LoadedAdapter, ProcessReader, ReaderSetup, ReadPhases, make_reader
from loraserve.lora.runtime import LoRARuntime

logger = logging.getLogger(__name__)

IN_MEMORY = "<in memory>"  # the path shown for adapters registered as objects
IN_MEMORY_VERSION = (IN_MEMORY,)  # an adapter object's weights never change behind its name
LOAD_HISTORY = 1024  # the most recent adapter load times kept for metrics
MAX_READ_WORKERS = 8  # adapters read side by side at most (reader processes)
# reads started (running or queued on the worker threads): this many per reader process (a prefill step takes as
# long as a few reads)
READ_QUEUE_FACTOR = 4
IDLE_WAIT_S = 0.01  # how long a step with nothing to run waits for a read


def read_workers() -> int:
    """Reads side by side with reader processes: one per two cores, 1 to MAX_READ_WORKERS (each reader process
    runs one torch thread at a lower priority, so the engine's thread keeps its core)."""
    return max(1, min(MAX_READ_WORKERS, (os.cpu_count() or 1) // 2))


@dataclass
class AdapterCounters:
    """Per-adapter counts since start (metrics)."""

    disk_loads: int = 0  # read from disk (or packed from its object) into the host cache
    gpu_loads: int = 0  # copied into the GPU pool
    gpu_evictions: int = 0
    load_seconds: float = 0.0  # time spent reading and packing it
    gpu_load_bytes: int = 0  # bytes copied host -> device
    queue_seconds: float = 0.0  # its requests' waits before their first step, summed
    requests_started: int = 0


@dataclass
class _Registered:
    path: str
    rank: int
    pages: int  # the pool pages it takes (its own rank, on the page blocks of the layers it targets)
    source: LoRAAdapter | None = None  # in-memory adapters: packed again from this when out of the host cache
    generation: int = 0  # its identity: new at registration and whenever it is read in another version
    version: tuple | None = None  # the version of its last read (files_version; IN_MEMORY_VERSION for objects)
    counters: AdapterCounters = field(default_factory=AdapterCounters)


class LoRAManager:
    def __init__(self, runtime: LoRARuntime):
        self.config: LoRAConfig = runtime.config
        self.runtime = runtime
        self.pool = runtime.pool
        self._registry: dict[str, _Registered] = {}
        self.refcounts: Counter[str] = Counter()
        self._pinned: set[str] = set()
        self._cpu: OrderedDict[str, PackedAdapter] = OrderedDict()  # oldest use first
        self._cpu_bytes = 0
        self._gpu: OrderedDict[str, int] = OrderedDict()  # resident adapter -> id, oldest use first
        self._copying: dict[int, torch.cuda.Event] = {}  # adapter id -> its load's event, until a step waits on it
        self._retired: dict[str, _Registered] = {}  # unregistered while requests were in flight
        self._reading: dict[str, Future] = {}  # disk reads on the worker threads (load-ahead)
        self._registering: dict[str, tuple[str, Future]] = {}  # name -> (path, its read): started registrations
        # with tensor parallelism rank 0 cuts every rank's part from the adapter it read: on a thread here
        reader_kind = "thread" if runtime.tp.is_parallel else self.config.lora_reader
        workers = read_workers()
        self._reader = make_reader(reader_kind,
                                   ReaderSetup(runtime.spec, self.config.max_lora_rank, runtime.packer),
                                   runtime.host, processes=workers)
        processes = isinstance(self._reader, ProcessReader)
        self._read_slots = workers if processes else 1
        # reads started at most, running or queued (the thread reader's hold the interpreter lock: one at a time)
        self._read_depth = READ_QUEUE_FACTOR * self._read_slots if processes else 1
        self._worker = ThreadPoolExecutor(max_workers=self._read_slots, thread_name_prefix="lora-load")
        self._queued_registrations: OrderedDict[str, str] = OrderedDict()  # name -> path, not started yet
        self.num_loads = 0  # adapters read from disk (or packed) since start
        self.num_gpu_loads = 0
        self.num_gpu_evictions = 0
        self.recent_load_seconds: deque[float] = deque(maxlen=LOAD_HISTORY)  # the last loads' times, oldest first
        self.recent_read_phases: deque[ReadPhases] = deque(maxlen=LOAD_HISTORY)  # the last reads' from disk, split
        self._generations = itertools.count(1)

    # -- what the scheduler asks ------------------------------------------------
    @property
    def pinned(self) -> frozenset[str]:
        """The adapters that stay in the GPU pool for good."""
        return frozenset(self._pinned)

    @property
    def num_pages(self) -> int:
        """The GPU pool's pages: the adapters of one step must fit in them together."""
        return self.pool.num_pages

    def pages_of(self, name: str) -> int:
        """The pool pages adapter `name` takes (registered or retired)."""
        return (self._registry.get(name) or self._retired[name]).pages

    def is_ready(self, name: str) -> bool:
        """Whether a step may take adapter `name` without waiting for a read: it is in the pool or the host cache,
        or its read failed (the step's `prepare` then raises the error, which fails its requests)."""
        if name in self._gpu or name in self._cpu:
            return True
        future = self._reading.get(name)
        return future is not None and future.done() and future.exception() is not None

    def identity(self, name: str) -> int:
        """What the weights adapter `name` (registered or retired) serves now stand for: a number no other
        registration or read of any adapter had. It changes when its files are read again in another version
        (they changed while it was out of the caches), so K/V computed with one set of weights is never taken
        for another's, whatever the name."""
        return self._entry(name).generation

    @property
    def paths(self) -> dict[str, str]:
        """Registered name -> path (IN_MEMORY for adapters given as objects)."""
        return {name: entry.path for name, entry in self._registry.items()}

    # -- registry ---------------------------------------------------------------
    def register(self, name: str, path: str, pinned: bool = False, loaded: LoadedAdapter | None = None) -> None:
        """Register `name` -> `path`, validating the adapter now. `loaded` is the result of `load` run
        beforehand (off the engine thread, so that reading the files does not stall decoding)."""
        entry = self._registry.get(name)
        if entry is not None:
            if entry.path != path:
                raise LoRAConflictError(f"LoRA adapter {name!r} is already registered with path {entry.path!r}")
        else:
            self._check_new(name)
            loaded = loaded if loaded is not None else self.load(name, path)
            if pinned:
                self._check_pin_room(name, loaded.packed.num_pages)
            entry = _Registered(path, loaded.rank, loaded.packed.num_pages)
            self._registry[name] = entry
            self._record_load(entry, loaded)
            self._cache_on_cpu(name, loaded.packed)
        if pinned:
            self._pin(name)

    def register_adapter(self, name: str, adapter: LoRAAdapter, pinned: bool = False) -> None:
        """Register an adapter built in memory (benchmarks, tests). Its tensors are kept (shared, not copied,
        when already in the model's dtype) and packed into the host cache when needed, like a folder's."""
        if name in self._registry:
            raise LoRAConflictError(f"LoRA adapter {name!r} is already registered")
        self._check_new(name)
        if adapter.max_rank > self.config.max_lora_rank:
            raise LoRAAdapterError(name, f"rank {adapter.max_rank} exceeds max_lora_rank {self.config.max_lora_rank}")
        pages = self.runtime.pages_of(adapter)
        if pinned:
            self._check_pin_room(name, pages)
        source = adapter.to(dtype=self.runtime.dtype)
        self._registry[name] = _Registered(IN_MEMORY, adapter.max_rank, pages, source, next(self._generations),
                                           IN_MEMORY_VERSION)
        if pinned:
            self._pin(name)

    def _check_new(self, name: str) -> None:
        """Refuse a new registration before any work: a name still being unloaded."""
        if name in self._retired:
            raise LoRAConflictError(f"LoRA adapter {name!r} is being unloaded; retry when its requests finish")

    def _check_pin_room(self, name: str, pages: int) -> None:
        """Pinned adapters (with `name`, of `pages` pages) must leave room in the pool for one adapter of
        max_lora_rank on every layer."""
        pinned = sum(self.pages_of(n) for n in self._pinned if n != name)
        if pinned + pages + self.pool.max_adapter_pages > self.pool.num_pages:
            raise InvalidRequestError(f"can't pin LoRA adapter {name!r}: pinned adapters must leave room for an "
                                      "adapter of max_lora_rank in the GPU pool")

    def _pin(self, name: str) -> None:
        """Keep `name` in the pool for good. Never evicts an adapter with requests in flight."""
        if name in self._pinned:
            return
        self._check_pin_room(name, self._registry[name].pages)
        try:
            self._ensure_resident(name, protected=set(self.refcounts) | self._pinned)
        except RuntimeError as exc:
            raise InvalidRequestError(f"can't pin LoRA adapter {name!r} now: the GPU pool is full of adapters with "
                                      "requests in flight; retry when they finish") from exc
        self._pinned.add(name)

    def unregister(self, name: str) -> None:
        entry = self._registry.pop(name, None)
        if entry is None:
            raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded")
        self._pinned.discard(name)
        if self.refcounts[name] > 0:
            self._retired[name] = entry
        else:
            self._drop(name)

    def registered(self) -> list[str]:
        return list(self._registry)

    def check_known(self, name: str) -> None:
        if name not in self._registry:
            raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded; load it first or name a known adapter")

    # -- request references ------------------------------------------------------
    def acquire(self, name: str) -> None:
        self.check_known(name)
        self.refcounts[name] += 1

    def release(self, name: str) -> None:
        self.refcounts[name] -= 1
        if self.refcounts[name] <= 0:
            del self.refcounts[name]
            if name in self._retired:
                del self._retired[name]
                self._drop(name)

    # -- the GPU pool ------------------------------------------------------------------
    def prepare(self, names: set[str], running: set[str]) -> dict[str, int]:
        """Make every adapter in `names` (one step's) resident; returns name -> adapter id. The current stream
        is ordered after their copies. Raises LoRAAdapterError for an adapter that can't be read any more."""
        protected = running | names | self._pinned
        ids = {name: self._ensure_resident(name, protected) for name in names}
        for adapter_id in ids.values():
            self.runtime.wait_for(self._copying.pop(adapter_id, None))
        return ids

    def prefetch(self, names: list[str], protected: set[str], idle: bool = False) -> None:
        """Load ahead the adapters of waiting requests, in order (`names`, the first to be admitted first), while
        the pool has room without evicting a protected adapter or one named here. Reads from disk go to the
        worker threads while the host cache has room for them (`_may_start_read`). Nothing here waits for a
        read or a copy, unless `idle` (no step to run): then it waits up to IDLE_WAIT_S for a read to finish."""
        running = [f for f in self._reading.values() if not f.done()] if idle else []  # (failed reads wait)
        if running:
            futures.wait(running, IDLE_WAIT_S, futures.FIRST_COMPLETED)
        self._collect_reads()
        keep = protected | set(names) | self._pinned
        in_flight, awaited = self._read_state()
        pool_full = False  # once one adapter finds no room, those after it don't take room before it
        for name in names:
            if name in self._gpu or name not in self._registry:
                continue
            packed = self._cpu.get(name)
            if packed is None:
                if name in self._reading:
                    continue
                nbytes = self._read_bytes(self._entry(name).pages)
                if self._may_start_read(nbytes, in_flight, awaited, first=name == names[0]):
                    self._start_read(name)
                    in_flight += 1
            elif not pool_full and self._make_room(self.pages_of(name), keep):
                self._load_to_gpu(name, packed)
            else:
                pool_full = True

    def _read_bytes(self, pages: int) -> int:
        """The most host bytes an adapter of `pages` pool pages takes once read (all ranks' parts, with tensor
        parallelism)."""
        return pages * self.pool.page_bytes * self.runtime.tp.size

    def _largest_read_bytes(self) -> int:
        """`_read_bytes` of an adapter of max_lora_rank on every layer: what a read not done yet may take."""
        return self._read_bytes(self.pool.max_adapter_pages)

    def _read_state(self) -> tuple[int, int]:
        """(reads in flight, host cache bytes of adapters that waiting requests need in the pool)."""
        in_flight = sum(not f.done() for f in self._reading.values()) + len(self._registering)
        return in_flight, sum(packed.nbytes for name, packed in self._cpu.items() if self._awaited(name))

    def _may_start_read(self, nbytes: int, in_flight: int, awaited: int, first: bool = False) -> bool:
        """Whether a read of `nbytes` may start beside `in_flight` reads and `awaited` bytes (`_read_state`): fewer
        reads than `_read_depth` are started (running or queued), and the host cache's budget holds it beside the
        reads in flight and the adapters read for waiting requests that are not in the pool yet (what it would
        push out is then only what no waiting request needs first). When no read is in flight, the adapter to be
        offered room first (`first`: the starving one, if any) is read whatever the budget, and so is any adapter
        while none waits in the host cache: every wait stays bounded, whatever the budget."""
        if in_flight >= self._read_depth:
            return False
        if in_flight == 0 and (first or awaited == 0):
            return True
        return awaited + in_flight * self._largest_read_bytes() + nbytes <= self.config.max_cpu_lora_memory * 2**30

    def _awaited(self, name: str) -> bool:
        """Whether requests wait for adapter `name` to come into the pool (its host copy is still to be used)."""
        return self.refcounts.get(name, 0) > 0 and name not in self._gpu

    def _ensure_resident(self, name: str, protected: set[str]) -> int:
        adapter_id = self._gpu.get(name)
        if adapter_id is not None:
            self._gpu.move_to_end(name)
            return adapter_id
        packed = self._cpu_adapter(name)
        if not self._make_room(packed.num_pages, protected):
            raise RuntimeError(f"no room in the GPU adapter pool for {name!r}: its {self.pool.free_pages} free "
                               f"pages are fewer than the {packed.num_pages} needed and every resident adapter "
                               "is running or pinned")
        return self._load_to_gpu(name, packed)

    def _make_room(self, pages: int, protected: set[str]) -> bool:
        """Evict least recently used unprotected adapters until `pages` are free; False if they can't be."""
        if self.pool.free_pages >= pages:
            return True
        victims, freed = [], self.pool.free_pages
        for name, adapter_id in self._gpu.items():
            if freed >= pages:
                break
            if name not in protected:
                victims.append(name)
                freed += self._entry(name).pages
        if freed < pages:
            return False
        for name in victims:
            self._evict(name)
        return True

    def _load_to_gpu(self, name: str, packed: PackedAdapter) -> int:
        adapter_id, event = self.runtime.load(packed)
        if event is not None:
            self._copying[adapter_id] = event
        self._gpu[name] = adapter_id
        counters = self._entry(name).counters
        counters.gpu_loads += 1
        counters.gpu_load_bytes += packed.nbytes
        self.num_gpu_loads += 1
        return adapter_id

    def _evict(self, name: str) -> None:
        adapter_id = self._gpu.pop(name)
        self._copying.pop(adapter_id, None)
        self.runtime.release(adapter_id)
        entry = self._registry.get(name) or self._retired.get(name)
        if entry is not None:
            entry.counters.gpu_evictions += 1
        self.num_gpu_evictions += 1

    def _drop(self, name: str) -> None:
        self._reading.pop(name, None)  # a read of it still running is not cached
        packed = self._cpu.pop(name, None)
        if packed is not None:
            self._cpu_bytes -= packed.nbytes
            self.runtime.release_host(packed)
        if name in self._gpu:
            self._evict(name)

    def _entry(self, name: str) -> _Registered:
        return self._registry.get(name) or self._retired[name]

    # -- the host cache -----------------------------------------------------------------
    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read, validate and pack an adapter (pinned on CUDA) with the reader. Touches no manager state: any
        thread. The files' version is taken before the read, so files that change during it are a new version
        at the next read."""
        version = files_version(path)
        loaded = self._reader.read(name, path)
        loaded.version = version
        return loaded

    def _read(self, name: str, entry: _Registered) -> LoadedAdapter:
        if entry.source is not None:
            start = time.perf_counter()
            packed = self.runtime.pack(entry.source)
            return LoadedAdapter(packed, entry.rank, time.perf_counter() - start, entry.version)
        return self.load(name, entry.path)

    def _start_read(self, name: str) -> None:
        if name not in self._reading:
            self._reading[name] = self._worker.submit(self._read, name, self._entry(name))

    def _collect_reads(self) -> None:
        """Move finished worker-thread reads into the host cache. A failed one stays until a step takes its
        adapter (`is_ready`), whose `prepare` raises its error."""
        for name in [n for n, f in self._reading.items() if f.done() and f.exception() is None]:
            loaded = self._reading.pop(name).result()
            if name in self._registry and name not in self._cpu:
                self._record_load(self._registry[name], loaded)
                self._cache_on_cpu(name, loaded.packed)

    def _record_load(self, entry: _Registered, loaded: LoadedAdapter) -> None:
        if loaded.version is None or loaded.version != entry.version:  # other weights may have been read
            entry.version, entry.generation = loaded.version, next(self._generations)
            entry.rank, entry.pages = loaded.rank, loaded.packed.num_pages
        self.num_loads += 1
        self.recent_load_seconds.append(loaded.seconds)
        if loaded.phases is not None:
            self.recent_read_phases.append(loaded.phases)
        entry.counters.disk_loads += 1
        entry.counters.load_seconds += loaded.seconds

    def _cache_on_cpu(self, name: str, packed: PackedAdapter) -> None:
        old = self._cpu.pop(name, None)
        if old is not None:
            self._cpu_bytes -= old.nbytes
            self.runtime.release_host(old)
        self._cpu[name] = packed
        self._cpu_bytes += packed.nbytes
        budget = self.config.max_cpu_lora_memory * 2**30
        count = self.config.max_cpu_loras
        while self._cpu_bytes > budget or (count is not None and len(self._cpu) > count):
            candidates = [n for n in self._cpu if n not in self._pinned and n != name]  # oldest use first
            victim = next((n for n in candidates if not self._awaited(n)), candidates[0] if candidates else None)
            if victim is None:
                break
            dropped = self._cpu.pop(victim)
            self._cpu_bytes -= dropped.nbytes
            self.runtime.release_host(dropped)

    def _cpu_adapter(self, name: str) -> PackedAdapter:
        packed = self._cpu.get(name)
        if packed is not None:
            self._cpu.move_to_end(name)
            return packed
        self._collect_reads()
        future = self._reading.pop(name, None)
        entry = self._entry(name)
        error = future.exception() if future is not None else None  # waits for a read still running
        if isinstance(error, LoRAAdapterError):
            raise error
        if error is not None:
            raise LoRAAdapterError(name, f"can't be read ({type(error).__name__}: {error})") from error
        loaded = future.result() if future is not None else self._read(name, entry)
        self._record_load(entry, loaded)
        self._cache_on_cpu(name, loaded.packed)
        return loaded.packed

    def record_queue_time(self, name: str, seconds: float) -> None:
        """A request of `name` ran its first step after waiting `seconds`."""
        entry = self._registry.get(name) or self._retired.get(name)
        if entry is not None:
            entry.counters.queue_seconds += seconds
            entry.counters.requests_started += 1

    # -- registration in the background -------------------------------------------------
    def start_register(self, name: str, path: str) -> None:
        """Queue a read of `path` on a worker thread; `collect_registrations` registers it once read. Reads start
        in the order queued, under the load-ahead's room rule. Nothing is read twice: a name already being
        registered in the background is left as it is."""
        if name not in self._registering and name not in self._queued_registrations:
            self._queued_registrations[name] = path
        self._start_registrations()

    def _start_registrations(self) -> None:
        """Start queued registration reads, first queued first, while `_may_start_read` allows."""
        estimate = self._largest_read_bytes()  # its pages are known once it is read
        in_flight, awaited = self._read_state()
        while self._queued_registrations and self._may_start_read(estimate, in_flight, awaited):
            name, path = self._queued_registrations.popitem(last=False)
            self._registering[name] = (path, self._worker.submit(self.load, name, path))
            in_flight += 1

    def collect_registrations(self, wait: float = 0.0) -> list[tuple[str, Exception | None]]:
        """Register the adapters whose background reads are done (waiting up to `wait` seconds for one when
        none is); returns (name, None) for each registered and (name, error) for each that could not be."""
        self._start_registrations()
        if wait > 0 and self._registering and not any(f.done() for _, f in self._registering.values()):
            futures.wait([f for _, f in self._registering.values()], wait, futures.FIRST_COMPLETED)
        done = []
        for name in [n for n, (_, f) in self._registering.items() if f.done()]:
            path, future = self._registering.pop(name)
            try:
                self.register(name, path, loaded=future.result())
            except Exception as exc:  # noqa: BLE001 (the error goes to the requests that wait for the adapter)
                if not isinstance(exc, ValueError):  # not LoRAAdapterError, LoRAConflictError, ...: unexpected
                    logger.error("LoRA adapter %r could not be registered", name, exc_info=exc)
                done.append((name, exc))
            else:
                done.append((name, None))
        self._start_registrations()  # in the room the finished reads leave
        return done

    def close(self) -> None:
        """Stop the worker threads (reads not started are dropped) and the reader; nothing is read after."""
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._reader.close()
        self._worker.shutdown(wait=True)

    # -- introspection ----------------------------------------------------------
    @property
    def reader(self):
        """The adapter reader (lora/reader.py: ThreadReader or ProcessReader)."""
        return self._reader

    @property
    def read_slots(self) -> int:
        """How many adapter reads run side by side at most."""
        return self._read_slots

    @property
    def resident_on_gpu(self) -> list[str]:
        return list(self._gpu)

    @property
    def resident_on_cpu(self) -> list[str]:
        return list(self._cpu)

    @property
    def cpu_cache_bytes(self) -> int:
        return self._cpu_bytes

    @property
    def pool_bytes_used(self) -> int:
        return self.pool.used_pages * self.pool.page_bytes

    @property
    def pool_bytes_total(self) -> int:
        return self.pool.num_pages * self.pool.page_bytes

    def counters(self) -> dict[str, AdapterCounters]:
        """Per registered adapter, its load/eviction counts (copies)."""
        return {name: AdapterCounters(**vars(entry.counters)) for name, entry in self._registry.items()}


def files_version(folder: str) -> tuple | None:
    """The version of an adapter folder's files: (name, inode, size, modification and change times) of each,
    so that files rewritten or replaced differ (copies keep a modification time, never a change time); None
    when the folder can't be listed (the read that follows says why)."""
    try:
        with os.scandir(folder) as entries:
            stats = [(e.name, e.stat()) for e in entries if e.is_file()]
    except OSError:
        return None
    return tuple(sorted((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for name, st in stats))
