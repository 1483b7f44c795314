"""Adapter manager: registry, CPU LRU cache, GPU slots.

- registry: name -> PEFT folder; registering validates the adapter at once.
- CPU cache: up to max_cpu_loras adapters in the model dtype (pinned memory on
  CUDA), least recently used first out; pinned adapters stay.
- GPU slots: max_loras slots in each LoRA layer's static storage, written
  through the LoRA runtime. An adapter needed by a step goes into a free slot or
  evicts the least recently used slot whose adapter is neither running nor
  pinned. Pinned adapters keep their slot.
- refcounts: requests in flight per adapter. An unregistered adapter refuses new
  requests; its in-flight requests finish with the weights already loaded.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque

from loraserve.config import LoRAConfig
from loraserve.errors import InvalidRequestError, LoRAConflictError, UnknownLoRAError
from loraserve.lora.adapter import LoRAAdapter, load_lora_adapter
from loraserve.lora.runtime import LoRARuntime

logger = logging.getLogger(__name__)

IN_MEMORY = "<in memory>"  # the path of adapters registered as objects: they can't be reloaded from disk
LOAD_HISTORY = 1024  # the most recent adapter load times kept for metrics


class LoRAManager:
    def __init__(self, runtime: LoRARuntime):
        self.config: LoRAConfig = runtime.config
        self.runtime = runtime
        self.paths: dict[str, str] = {}
        self.refcounts: Counter[str] = Counter()
        self._pinned: set[str] = set()
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slots: list[str | None] = [None] * self.config.max_loras
        self._slot_lru: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, oldest use first
        self._retired: dict[str, str] = {}  # name -> path: unregistered while requests were in flight
        self.num_loads = 0  # adapters read from disk since start
        self.recent_load_seconds: deque[float] = deque(maxlen=LOAD_HISTORY)  # the last loads' times, oldest first

    @property
    def pinned(self) -> frozenset[str]:
        """The adapters that hold a GPU slot for good."""
        return frozenset(self._pinned)

    # -- registry ---------------------------------------------------------------
    def register(self, name: str, path: str, pinned: bool = False,
                 loaded: tuple[LoRAAdapter, float] | None = None) -> None:
        """Register `name` -> `path`, validating the adapter now. `loaded` is the result of `load`
        run beforehand (off the engine thread, so that reading the files does not stall decoding)."""
        if name in self.paths:
            if self.paths[name] != path:
                raise LoRAConflictError(f"LoRA adapter {name!r} is already registered with path {self.paths[name]!r}")
        else:
            self._check_new(name, pinned)
            adapter, seconds = loaded if loaded is not None else self.load(name, path)
            self._record_load(seconds)
            self._cache_on_cpu(name, adapter)
            self.paths[name] = path
        if pinned:
            self._pin(name)

    def register_adapter(self, name: str, adapter: LoRAAdapter, pinned: bool = False) -> None:
        """Register an adapter built in memory (benchmarks, tests); it stays in the CPU cache."""
        if name in self.paths:
            raise LoRAConflictError(f"LoRA adapter {name!r} is already registered")
        self._check_new(name, pinned)
        self._cache_on_cpu(name, adapter.to(dtype=self.runtime.dtype, pin_memory=self.runtime.device.type == "cuda"))
        self.paths[name] = IN_MEMORY
        if pinned:
            self._pin(name)

    def _check_new(self, name: str, pinned: bool) -> None:
        """Refuse a new registration before any work: a name still being unloaded, or no room to pin."""
        if name in self._retired:
            raise LoRAConflictError(f"LoRA adapter {name!r} is being unloaded; retry when its requests finish")
        if pinned:
            self._check_pin_room(name)

    def _check_pin_room(self, name: str) -> None:
        """At most max_loras - 1 pinned adapters, so one slot always rotates."""
        if len(self._pinned) + 1 >= self.config.max_loras:
            raise InvalidRequestError(f"can't pin LoRA adapter {name!r}: at most max_loras - 1 = "
                                      f"{self.config.max_loras - 1} adapters can be pinned")

    def _pin(self, name: str) -> None:
        """Give `name` a slot for good. Never takes the slot of an adapter with requests in flight."""
        if name in self._pinned:
            return
        self._check_pin_room(name)
        try:
            self._ensure_slot(name, protected=set(self.refcounts) | self._pinned)
        except RuntimeError as exc:
            raise InvalidRequestError(f"can't pin LoRA adapter {name!r} now: every GPU slot holds an adapter "
                                      "with requests in flight; retry when they finish") from exc
        self._pinned.add(name)

    def unregister(self, name: str) -> None:
        if name not in self.paths:
            raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded")
        path = self.paths.pop(name)
        self._pinned.discard(name)
        if self.refcounts[name] > 0:
            self._retired[name] = path
        else:
            self._drop(name)

    def registered(self) -> list[str]:
        return list(self.paths)

    def check_known(self, name: str) -> None:
        if name not in self.paths:
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

    # -- slots -------------------------------------------------------------------
    def prepare_slots(self, names: set[str], running: set[str]) -> dict[str, int]:
        """Make sure every adapter in `names` sits in a GPU slot; returns name -> slot."""
        protected = running | names | self._pinned
        return {name: self._ensure_slot(name, protected) for name in names}

    def _ensure_slot(self, name: str, protected: set[str]) -> int:
        if name in self._slot_lru:
            self._slot_lru.move_to_end(name)
            return self._slot_lru[name]
        slot = self._free_slot(protected)
        self.runtime.write_slot(slot, self._cpu_adapter(name))
        self._slots[slot] = name
        self._slot_lru[name] = slot
        return slot

    def _free_slot(self, protected: set[str]) -> int:
        if None in self._slots:
            return self._slots.index(None)
        for victim in self._slot_lru:
            if victim not in protected:
                slot = self._slot_lru.pop(victim)
                self._clear(slot)
                return slot
        raise RuntimeError("no LoRA slot can be freed: every slot holds a running or pinned adapter")

    def _clear(self, slot: int) -> None:
        self.runtime.clear_slot(slot)
        self._slots[slot] = None

    def _drop(self, name: str) -> None:
        self._cpu.pop(name, None)
        slot = self._slot_lru.pop(name, None)
        if slot is not None:
            self._clear(slot)

    # -- CPU cache -----------------------------------------------------------------
    def load(self, name: str, path: str) -> tuple[LoRAAdapter, float]:
        """Read, validate and convert an adapter (pinned on CUDA); returns it and the seconds it took.

        Touches no manager state, so it may run on any thread.
        """
        start = time.perf_counter()
        adapter = load_lora_adapter(name, path, self.runtime.spec, self.config.max_lora_rank)
        adapter = adapter.to(dtype=self.runtime.dtype, pin_memory=self.runtime.device.type == "cuda")
        return adapter, time.perf_counter() - start

    def _record_load(self, seconds: float) -> None:
        self.num_loads += 1
        self.recent_load_seconds.append(seconds)

    def _cache_on_cpu(self, name: str, adapter: LoRAAdapter) -> None:
        self._cpu[name] = adapter
        self._cpu.move_to_end(name)
        while len(self._cpu) > self.config.max_cpu_loras:
            victim = next((n for n in self._cpu if n not in self._pinned and n != name
                           and self.paths.get(n) != IN_MEMORY), None)
            if victim is None:
                break
            del self._cpu[victim]

    def _cpu_adapter(self, name: str) -> LoRAAdapter:
        adapter = self._cpu.get(name)
        if adapter is None:
            adapter, seconds = self.load(name, self.paths.get(name) or self._retired[name])
            self._record_load(seconds)
            self._cache_on_cpu(name, adapter)
        else:
            self._cpu.move_to_end(name)
        return adapter

    # -- introspection ----------------------------------------------------------
    @property
    def resident_on_gpu(self) -> list[str]:
        return list(self._slot_lru)

    @property
    def resident_on_cpu(self) -> list[str]:
        return list(self._cpu)

    @property
    def num_slots_used(self) -> int:
        return sum(s is not None for s in self._slots)
