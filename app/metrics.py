"""Prometheus metrics of one app: request latency by route, and query latency by stage."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Seconds; dense below 100 ms, where a healthy single-image query lands on CPU.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Collectors in a registry of their own, so that several apps in one process (tests) do not clash."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "dmlsearch_request_duration_seconds",
            "HTTP request latency, by method, route template and status code.",
            ["method", "route", "status"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.stages = Histogram(
            "dmlsearch_stage_duration_seconds",
            "Latency of one stage of a query: upload (receiving it), queue (waiting for a compute slot), "
            "decode, preprocess, embed, search.",
            ["stage"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "dmlsearch_requests_in_flight", "HTTP requests being served.", registry=self.registry
        )
        self.rate_limited = Counter(
            "dmlsearch_rate_limited_total", "Requests refused with 429.", registry=self.registry
        )
        self.index_items = Gauge(
            "dmlsearch_index_items", "Items in the served index (-1 when not ready).", registry=self.registry
        )

    def track_index_size(self, size: Callable[[], int]) -> None:
        """Read the index size at scrape time rather than updating it on every write."""
        self.index_items.set_function(size)

    def observe_stages(self, timings_ms: Mapping[str, float]) -> None:
        for stage, milliseconds in timings_ms.items():
            self.stages.labels(stage).observe(milliseconds / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
