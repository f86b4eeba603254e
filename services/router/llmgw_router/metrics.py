"""Prometheus metrics of one router, on its own registry (no process-wide singleton).

Counters and histograms are updated on the request path through cached label children; gauges
(in-flight, queue depth, breaker states) are read from the live structures at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw_router.admission import Gate
from llmgw_router.breaker import STATE_VALUE
from llmgw_router.endpoints import Pool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _Live(Collector):
    def __init__(self, pool: Pool, gates: dict[str, Gate], in_flight: Callable[[], int]) -> None:
        self.pool, self.gates, self.in_flight = pool, gates, in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("llmgw_router_in_flight", "Requests being proxied now")
        g.add_metric([], self.in_flight())
        yield g
        ep = GaugeMetricFamily(
            "llmgw_router_endpoint_in_flight", "Requests in flight per endpoint", labels=["model", "replica"]
        )
        br = GaugeMetricFamily(
            "llmgw_router_breaker_state",
            "Circuit breaker per endpoint: 0 closed, 1 half-open, 2 open",
            labels=["model", "replica", "state"],
        )
        for st in self.pool.by_key.values():
            ep.add_metric([st.model, st.replica_id], st.in_flight)
            br.add_metric([st.model, st.replica_id, st.breaker.state.value], STATE_VALUE[st.breaker.state])
        yield ep
        yield br
        q = GaugeMetricFamily("llmgw_router_queue_depth", "Requests waiting for admission", labels=["model"])
        a = GaugeMetricFamily("llmgw_router_admitted", "Requests admitted and running", labels=["model"])
        for name, gate in self.gates.items():
            q.add_metric([name], gate.queued)
            a.add_metric([name], gate.active)
        yield q
        yield a


class RouterMetrics:
    def __init__(self, pool: Pool, gates: dict[str, Gate], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by model and HTTP status",
            ["model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "llmgw_router_request_seconds",
            "Time from request to last byte",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmgw_router_ttft_seconds",
            "Time from request to the engine's first byte",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "llmgw_router_retries",
            "Requests retried on another endpoint before the first byte",
            ["model"],
            registry=self.registry,
        )
        self.registry.register(_Live(pool, gates, in_flight))
        self._req: dict[tuple[str, int], Counter] = {}
        self._lat: dict[str, Histogram] = {}
        self._ttft: dict[str, Histogram] = {}

    def request(self, model: str, status: int, seconds: float | None = None) -> None:
        c = self._req.get((model, status))
        if c is None:
            c = self._req[(model, status)] = self.requests.labels(model, str(status))
        c.inc()
        if seconds is not None:
            h = self._lat.get(model)
            if h is None:
                h = self._lat[model] = self.latency.labels(model)
            h.observe(seconds)

    def first_byte(self, model: str, seconds: float) -> None:
        h = self._ttft.get(model)
        if h is None:
            h = self._ttft[model] = self.ttft.labels(model)
        h.observe(seconds)

    def retry(self, model: str) -> None:
        self.retries.labels(model).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
