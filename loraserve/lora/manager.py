"""Adapter manager: registry, CPU LRU cache, GPU slots.

- registry: name -> PEFT folder; registering validates the adapter at once.
- CPU cache: up to max_cpu_loras adapters in the model dtype (pinned memory on
  CUDA), least recently used first out; pinned adapters stay.
- GPU slots: max_loras slots in each LoRA layer's static storage. An adapter
  needed by a step goes into a free slot or evicts the least recently used slot
  whose adapter is neither running nor pinned. Pinned adapters keep their slot.
- refcounts: requests in flight per adapter. An unregistered adapter refuses new
  requests; its in-flight requests finish with the weights already loaded.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

import torch

from loraserve.config import LoRAConfig
from loraserve.errors import InvalidRequestError, LoRAConflictError, UnknownLoRAError
from loraserve.lora.adapter import LoRAAdapter, LoRAModelSpec, load_lora_adapter
from loraserve.lora.layers import LoRALinear

logger = logging.getLogger(__name__)

IN_MEMORY = "<in memory>"  # the path of adapters registered as objects: they can't be reloaded from disk


class LoRAManager:
    def __init__(self, config: LoRAConfig, layers: list[tuple[int, LoRALinear]], spec: LoRAModelSpec,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.layers = layers
        self.spec = spec
        self.device, self.dtype = device, dtype
        self.paths: dict[str, str] = {}
        self.pinned: set[str] = set()
        self.refcounts: Counter[str] = Counter()
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slots: list[str | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, oldest use first
        self._retired: dict[str, str] = {}  # name -> path: unregistered while requests were in flight
        self.load_seconds: list[float] = []
        # slot writes go on a side stream from pinned memory; the step's stream waits on an event
        self._load_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

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
            self.load_seconds.append(seconds)
            self._cache_on_cpu(name, adapter)
            self.paths[name] = path
        if pinned:
            self._pin(name)

    def register_adapter(self, name: str, adapter: LoRAAdapter, pinned: bool = False) -> None:
        """Register an adapter built in memory (benchmarks, tests); it stays in the CPU cache."""
        if name in self.paths:
            raise LoRAConflictError(f"LoRA adapter {name!r} is already registered")
        self._check_new(name, pinned)
        self._cache_on_cpu(name, adapter.to(dtype=self.dtype, pin_memory=self.device.type == "cuda"))
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
        if len(self.pinned) + 1 >= self.config.max_loras:
            raise InvalidRequestError(f"can't pin LoRA adapter {name!r}: at most max_loras - 1 = "
                                      f"{self.config.max_loras - 1} adapters can be pinned")

    def _pin(self, name: str) -> None:
        """Give `name` a slot for good. Never takes the slot of an adapter with requests in flight."""
        if name in self.pinned:
            return
        self._check_pin_room(name)
        try:
            self._ensure_slot(name, protected=set(self.refcounts) | self.pinned)
        except RuntimeError as exc:
            raise InvalidRequestError(f"can't pin LoRA adapter {name!r} now: every GPU slot holds an adapter "
                                      "with requests in flight; retry when they finish") from exc
        self.pinned.add(name)

    def unregister(self, name: str) -> None:
        if name not in self.paths:
            raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded")
        path = self.paths.pop(name)
        self.pinned.discard(name)
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
        protected = running | names | self.pinned
        return {name: self._ensure_slot(name, protected) for name in names}

    def _ensure_slot(self, name: str, protected: set[str]) -> int:
        if name in self._slot_lru:
            self._slot_lru.move_to_end(name)
            return self._slot_lru[name]
        slot = self._free_slot(protected)
        adapter = self._cpu_adapter(name)
        self._write_slot(slot, adapter)
        self._slots[slot] = name
        self._slot_lru[name] = slot
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy the adapter into `slot` of every layer; on CUDA on the side stream, which the
        current stream then waits for, so the copy overlaps host work and earlier GPU work.

        The slot was empty or held an adapter no running request uses, so no step in
        flight reads it (steps sync on their sampled tokens before the next is scheduled).
        """
        if self._load_stream is None:
            for layer_idx, layer in self.layers:
                layer.write_slot(slot, [adapter.weights.get((layer_idx, m)) for m in layer.slice_names])
            return
        with torch.cuda.stream(self._load_stream):
            for layer_idx, layer in self.layers:
                layer.write_slot(slot, [adapter.weights.get((layer_idx, m)) for m in layer.slice_names])
            done = torch.cuda.Event()
            done.record(self._load_stream)
        torch.cuda.current_stream(self.device).wait_event(done)

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
        for _, layer in self.layers:
            layer.clear_slot(slot)
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
        adapter = load_lora_adapter(name, path, self.spec, self.config.max_lora_rank)
        adapter = adapter.to(dtype=self.dtype, pin_memory=self.device.type == "cuda")
        return adapter, time.perf_counter() - start

    def _cache_on_cpu(self, name: str, adapter: LoRAAdapter) -> None:
        self._cpu[name] = adapter
        self._cpu.move_to_end(name)
        while len(self._cpu) > self.config.max_cpu_loras:
            victim = next((n for n in self._cpu if n not in self.pinned and n != name
                           and self.paths.get(n) != IN_MEMORY), None)
            if victim is None:
                break
            del self._cpu[victim]

    def _cpu_adapter(self, name: str) -> LoRAAdapter:
        adapter = self._cpu.get(name)
        if adapter is None:
            adapter, seconds = self.load(name, self.paths.get(name) or self._retired[name])
            self.load_seconds.append(seconds)
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
