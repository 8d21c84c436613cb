"""``GET /metrics``: the server's Prometheus metrics (prometheus-client), one registry per app.

Requests by route and status, the time a request waited for a slot and the time it ran, each
stage's time per request, time to first audio (a whole response's latency until streaming lands),
audio seconds written, engine deaths, and the payload bytes each transport carried between
stages. vLLM's own engine metrics are not exported: each ``AsyncLLM`` registers its Prometheus
logger under the same metric names in the process-wide registry and unregisters the previous
engine's, so with one engine per stage they would describe only the last stage started.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ServerMetrics:
    def __init__(self, pipeline: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("omnigen_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.request_seconds = Histogram(
            "omnigen_request_seconds",
            "Time from arrival to answer",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "omnigen_queue_seconds",
            "Time a request waited for a pipeline slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "omnigen_stage_seconds",
            "Time a request spent in a stage",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_queue_seconds = Histogram(
            "omnigen_stage_queue_seconds",
            "Time a request waited in a stage engine's queue",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_run_seconds = Histogram(
            "omnigen_stage_run_seconds",
            "Time from a request's first step in a stage to its last token",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_audio_seconds = Histogram(
            "omnigen_time_to_first_audio_seconds",
            "Time from arrival to the first audio sample sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter("omnigen_audio_seconds", "Seconds of audio written", registry=r)
        self.engine_deaths = Counter(
            "omnigen_engine_deaths", "Stage engines found dead", ["stage"], registry=r
        )
        self.running = Gauge("omnigen_requests_running", "Requests in the pipeline", registry=r)
        self.queued = Gauge("omnigen_requests_queued", "Requests waiting for a pipeline slot", registry=r)
        r.register(_PayloadBytes(pipeline))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PayloadBytes:
    """Read at scrape time from the pipeline's own count (``Pipeline.payload_bytes``)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "omnigen_payload_bytes", "Payload bytes handed between stages, by transport", labels=["transport"]
        )
        for name, count in sorted(getattr(self.pipeline, "payload_bytes", {}).items()):
            family.add_metric([name], count)
        yield family
