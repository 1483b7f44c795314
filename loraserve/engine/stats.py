"""A snapshot of the engine's state for /metrics and tests."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    lora_slots_total: int
    lora_slots_used: int
    loras_on_gpu: list[str] = field(default_factory=list)  # adapters resident in device slots
    loras_on_cpu: list[str] = field(default_factory=list)  # adapters in the CPU cache
    lora_refcounts: dict[str, int] = field(default_factory=dict)  # requests in flight per adapter
    lora_loads: int = 0  # adapters read from disk since start
    lora_recent_load_seconds: list[float] = field(default_factory=list)  # the last loads' times, oldest first
