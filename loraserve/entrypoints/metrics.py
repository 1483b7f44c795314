"""Prometheus metrics of one server app, kept on a registry of its own (never the global one).

Counters and latency histograms are updated as requests run; the engine's
state (requests, KV blocks, the adapter pool's and host cache's bytes,
residency, per-adapter loads, evictions, load and queue seconds, references,
prefix cache queries and hits) is read from an EngineStats snapshot taken at each scrape, so adapters that are
gone disappear from the labels.
"""
from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraserve.engine.stats import EngineStats
from loraserve.outputs import RequestOutput

BASE_MODEL_LABEL = "__base__"
UNKNOWN_MODEL_LABEL = "__unknown__"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _EngineStateCollector:
    """Gauges built from the last EngineStats snapshot."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        yield _gauge("loraserve_num_requests_running", "Requests being decoded or prefilled.", s.num_running)
        yield _gauge("loraserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield _gauge("loraserve_kv_cache_blocks_total", "KV-cache blocks in the pool.", s.kv_blocks_total)
        yield _gauge("loraserve_kv_cache_blocks_used", "KV-cache blocks held by requests.", s.kv_blocks_used)
        yield _gauge("loraserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.",
                     s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield _gauge("loraserve_lora_pool_bytes_total", "Bytes of the GPU adapter pool.", s.lora_pool_bytes_total)
        yield _gauge("loraserve_lora_pool_bytes_used", "Bytes of the GPU adapter pool holding adapters.",
                     s.lora_pool_bytes_used)
        yield _gauge("loraserve_lora_cpu_cache_bytes", "Bytes of adapters cached in host memory.",
                     s.lora_cpu_cache_bytes)
        yield _gauge("loraserve_loras_on_gpu", "Adapters resident in the GPU pool.", len(s.loras_on_gpu))
        yield _gauge("loraserve_loras_on_cpu", "Adapters in the host cache.", len(s.loras_on_cpu))
        yield CounterMetricFamily("loraserve_lora_gpu_loads", "Adapters copied into the GPU pool.",
                                  value=s.lora_gpu_loads)
        yield CounterMetricFamily("loraserve_lora_gpu_evictions", "Adapters evicted from the GPU pool.",
                                  value=s.lora_gpu_evictions)
        per_adapter = {
            key: CounterMetricFamily(f"loraserve_lora_adapter_{key}", doc, labels=["adapter"])
            for key, doc in (("disk_loads", "Reads of each adapter from disk into the host cache."),
                             ("gpu_loads", "Copies of each adapter into the GPU pool."),
                             ("gpu_evictions", "Evictions of each adapter from the GPU pool."),
                             ("load_seconds", "Seconds spent reading each adapter."),
                             ("queue_seconds", "Seconds each adapter's requests waited before their first step."),
                             ("requests_started", "Requests of each adapter that started running."))}
        for name, counts in sorted(s.lora_adapters.items()):
            for key, family in per_adapter.items():
                family.add_metric([name], counts[key])
        yield from per_adapter.values()
        resident = GaugeMetricFamily("loraserve_lora_resident", "1 for each adapter and where it is resident.",
                                     labels=["adapter", "location"])
        for location, names in (("gpu", s.loras_on_gpu), ("cpu", s.loras_on_cpu)):
            for name in sorted(names):
                resident.add_metric([name, location], 1)
        yield resident
        yield CounterMetricFamily("loraserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("loraserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=s.prefix_cache_hits)
        hit_rate = GaugeMetricFamily("loraserve_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / looked up, since start, per adapter.",
                                     labels=["adapter"])
        for name, counts in sorted(s.prefix_cache_adapters.items(), key=lambda item: item[0] or ""):
            if counts["queries"]:
                hit_rate.add_metric([name or BASE_MODEL_LABEL], counts["hits"] / counts["queries"])
        yield hit_rate
        refs = GaugeMetricFamily("loraserve_lora_requests_in_flight",
                                 "Requests in flight holding a reference to each adapter.", labels=["adapter"])
        for name, count in sorted(s.lora_refcounts.items()):
            refs.add_metric([name], count)
        yield refs


class ServerMetrics:
    """The metrics of one app; `render()` gives the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter("loraserve_requests", "Requests by model/adapter and outcome.",
                                 ["adapter", "outcome"], registry=self.registry)
        self._lora_load = Histogram("loraserve_lora_load_seconds", "Time to read and validate an adapter from disk.",
                                    buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("loraserve_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("loraserve_inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._loads_seen = 0  # adapter loads already in the histogram
        self._state = _EngineStateCollector()
        self.registry.register(self._state)

    def record_request(self, adapter: str, outcome: str) -> None:
        """outcome: success, aborted (client went away), rejected (4xx), overloaded (503) or error (5xx)."""
        self._requests.labels(adapter=adapter, outcome=outcome).inc()

    def update(self, stats: EngineStats) -> None:
        """Take a new snapshot; adapter loads since the last one go into the load-time histogram."""
        new = stats.lora_loads - self._loads_seen
        for seconds in stats.lora_recent_load_seconds[max(0, len(stats.lora_recent_load_seconds) - new):]:
            self._lora_load.observe(seconds)
        self._loads_seen = stats.lora_loads
        self._state.stats = stats

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class TokenTimer:
    """Turns the arrival times of each request's outputs into TTFT and inter-token latencies."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self._metrics = metrics
        self._arrival = arrival
        self._last: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens so far)

    def observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        tokens = sum(len(c.token_ids) for c in output.outputs)
        last = self._last.get(output.request_id)
        if last is None:
            if tokens:
                self._metrics.ttft.observe(now - self._arrival)
                self._last[output.request_id] = (now, tokens)
            return
        t, seen = last
        if tokens > seen:
            for _ in range(tokens - seen):
                self._metrics.itl.observe((now - t) / (tokens - seen))
            self._last[output.request_id] = (now, tokens)
