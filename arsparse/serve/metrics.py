"""Prometheus metrics: per-policy scheduler gauges read at scrape time, request counts and latencies."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = {
    "queue_length": "requests waiting for slots",
    "running_images": "images decoding now (the running batch)",
    "max_running_images": "largest running batch so far",
    "slots": "images the slot pool holds at most",
    "tokens_per_second": "tokens sampled per second over the last 5 s",
    "kv_bytes_in_use": "KV cache bytes held by running images",
    "kv_bytes_capacity": "KV cache bytes of the slot pool",
}


class _SchedulerCollector:
    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        stats = [s.stats() for s in self.pool.schedulers()]
        for key, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"arsparse_{key}", doc, labels=["policy", "mode"])
            for st in stats:
                g.add_metric([st["policy"], st["mode"]], float(st[key]))
            yield g
        c = CounterMetricFamily("arsparse_tokens", "image tokens sampled", labels=["policy", "mode"])
        for st in stats:
            c.add_metric([st["policy"], st["mode"]], float(st["tokens_total"]))
        yield c


class ServeMetrics:
    """A registry of its own (so several apps can live in one process, as in tests)."""

    def __init__(self, pool):
        self.registry = CollectorRegistry()
        self.requests = Counter("arsparse_requests", "generate requests answered, by policy and HTTP status",
                                ["policy", "status"], registry=self.registry)
        self.latency = Histogram("arsparse_request_latency_seconds", "time from arrival to answer of generate requests",
                                 ["policy"], registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, float("inf")))
        self.registry.register(_SchedulerCollector(pool))

    def observe(self, policy: str, status: int, seconds: float) -> None:
        self.requests.labels(policy, str(status)).inc()
        self.latency.labels(policy).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
