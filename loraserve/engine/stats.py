"""A snapshot of the engine's state for /metrics and tests."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheCounts:
    """Prefix cache lookups since start (of one adapter, or of the base model)."""

    queries: int = 0  # tokens of the sequences looked up when they started
    hits: int = 0  # of them, tokens found cached (not computed again)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    lora_pool_bytes_total: int = 0  # the GPU adapter pool
    lora_pool_bytes_used: int = 0  # its pages holding adapters
    lora_cpu_cache_bytes: int = 0  # adapters cached in host memory
    loras_on_gpu: list[str] = field(default_factory=list)  # adapters resident in the GPU pool
    loras_on_cpu: list[str] = field(default_factory=list)  # adapters in the host cache
    lora_refcounts: dict[str, int] = field(default_factory=dict)  # requests in flight per adapter
    lora_loads: int = 0  # adapters read from disk (or packed) since start
    lora_gpu_loads: int = 0  # adapters copied into the GPU pool since start
    lora_gpu_evictions: int = 0  # adapters evicted from the GPU pool since start
    lora_recent_load_seconds: list[float] = field(default_factory=list)  # the last loads' times, oldest first
    # per registered adapter: disk_loads, gpu_loads, gpu_evictions, load_seconds, gpu_load_bytes,
    # queue_seconds (summed over its requests' waits before their first step), requests_started
    lora_adapters: dict[str, dict[str, float]] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # tokens of starting requests looked up in the prefix cache since start
    prefix_cache_hits: int = 0  # of them, tokens found cached (not computed)
    # per adapter registered now (None: the base model): {"queries": ..., "hits": ...} since start
    prefix_cache_adapters: dict[str | None, dict[str, int]] = field(default_factory=dict)
