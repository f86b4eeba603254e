"""Prometheus metrics of one router, on its own registry (no process-wide singleton).

On the request path a counter is one dict increment and a histogram observation one ``bisect`` and
two list/float updates: prometheus_client's ``Counter``/``Histogram`` children (a lock and a value
object per update) were about 5% of the router's CPU per request in its profile. The exposition is
built from these plain numbers at scrape time, with the same names, labels and ``_created`` series
as prometheus_client's own metrics; gauges (in-flight, queue depth, breaker states) are read from the
live structures at scrape time too.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _untyped_go_float

from llmgw_router.routing.breaker import STATE_VALUE
from llmgw_router.routing.endpoints import Pool
from llmgw_router.tenancy.admission import Gate

# Prometheus' spelling of a bucket bound ("0.005", "1.0"); its helper carries no annotations.
_go_float: Callable[[float], str] = _untyped_go_float
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Holds last from a moment (a replica already coming) to a cold start (minutes).
_HOLD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


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
        h = GaugeMetricFamily(
            "llmgw_router_held",
            "Requests held for a model with no ready replica while one is coming or waking",
            labels=["model"],
        )
        for name, gate in self.gates.items():
            q.add_metric([name], gate.queued)
            a.add_metric([name], gate.active)
            h.add_metric([name], gate.held)
        yield q
        yield a
        yield h


class _Hist:
    """One histogram child: counts per bucket (the last one is +Inf), the sum, when it was created."""

    __slots__ = ("counts", "created", "sum")

    def __init__(self, n_buckets: int) -> None:
        self.counts = [0] * (n_buckets + 1)
        self.sum = 0.0
        self.created = time.time()


class _Counter:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0
        self.created = time.time()


def _counter_family(
    name: str, doc: str, labelnames: tuple[str, ...], children: dict[tuple[str, ...], _Counter]
) -> Iterator[Metric]:
    total = Metric(name, doc, "counter")
    created = Metric(name + "_created", doc, "gauge")
    for values, c in list(children.items()):
        labels = dict(zip(labelnames, values, strict=True))
        total.add_sample(name + "_total", labels, float(c.value))
        created.add_sample(name + "_created", labels, c.created)
    yield total
    if created.samples:
        yield created


def _histogram_family(
    name: str, doc: str, label: str, buckets: tuple[float, ...], children: dict[str, _Hist]
) -> Iterator[Metric]:
    hist = Metric(name, doc, "histogram")
    created = Metric(name + "_created", doc, "gauge")
    bounds = [_go_float(b) for b in buckets] + ["+Inf"]
    for value, h in list(children.items()):
        acc = 0
        for bound, n in zip(bounds, h.counts, strict=True):
            acc += n
            hist.add_sample(name + "_bucket", {"le": bound, label: value}, float(acc))
        hist.add_sample(name + "_count", {label: value}, float(acc))
        hist.add_sample(name + "_sum", {label: value}, h.sum)
        created.add_sample(name + "_created", {label: value}, h.created)
    yield hist
    if created.samples:
        yield created


class _Recorded(Collector):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        yield from _counter_family(
            "llmgw_router_requests",
            "Requests answered, by model and HTTP status",
            ("model", "status"),
            {(k[0], str(k[1])): c for k, c in m._req.items()},
        )
        yield from _histogram_family(
            "llmgw_router_request_seconds",
            "Time from request to last byte",
            "model",
            _LATENCY_BUCKETS,
            m._lat,
        )
        yield from _histogram_family(
            "llmgw_router_ttft_seconds",
            "Time from request to the engine's first byte",
            "model",
            _TTFT_BUCKETS,
            m._ttft,
        )
        yield from _histogram_family(
            "llmgw_router_hold_seconds",
            "Time a request was held for a model with no ready replica (coming or waking)",
            "model",
            _HOLD_BUCKETS,
            m._hold,
        )
        yield from _counter_family(
            "llmgw_router_retries",
            "Requests retried on another endpoint before the first byte",
            ("model",),
            {(k,): c for k, c in m._retries.items()},
        )
        yield from _counter_family(
            "llmgw_router_migrations",
            "Streams that broke after their first byte, by outcome: ok (continued on another replica), "
            "failed (no replica could continue it), unsupported (an answer that cannot be continued), "
            "off (failover disabled for the model)",
            ("model", "outcome"),
            dict(m._migrations.items()),
        )


class RouterMetrics:
    def __init__(self, pool: Pool, gates: dict[str, Gate]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._req: dict[tuple[str, int], _Counter] = {}
        self._lat: dict[str, _Hist] = {}
        self._ttft: dict[str, _Hist] = {}
        self._retries: dict[str, _Counter] = {}
        self._migrations: dict[tuple[str, str], _Counter] = {}
        self._hold: dict[str, _Hist] = {}
        self.registry.register(_Recorded(self))
        # Requests being proxied now (an attempt at a first answer under way).
        self.in_flight = 0
        # The same, and those waiting in their base's admission queue, per LoRA adapter (demand.py: an
        # adapter shares its base's endpoints and gate, so neither counts it apart).
        self.adapter_in_flight: dict[str, int] = {}
        self.adapter_queued: dict[str, int] = {}
        self.registry.register(_Live(pool, gates, lambda: self.in_flight))

    def request(self, model: str, status: int, seconds: float | None = None) -> None:
        c = self._req.get((model, status))
        if c is None:
            c = self._req[(model, status)] = _Counter()
        c.value += 1
        if seconds is not None:
            h = self._lat.get(model)
            if h is None:
                h = self._lat[model] = _Hist(len(_LATENCY_BUCKETS))
            # bisect_left: a value equal to a bound belongs to that bucket (Prometheus' "le").
            h.counts[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
            h.sum += seconds

    def first_byte(self, model: str, seconds: float) -> None:
        h = self._ttft.get(model)
        if h is None:
            h = self._ttft[model] = _Hist(len(_TTFT_BUCKETS))
        h.counts[bisect_left(_TTFT_BUCKETS, seconds)] += 1
        h.sum += seconds

    def hold(self, model: str, seconds: float) -> None:
        h = self._hold.get(model)
        if h is None:
            h = self._hold[model] = _Hist(len(_HOLD_BUCKETS))
        h.counts[bisect_left(_HOLD_BUCKETS, seconds)] += 1
        h.sum += seconds

    def retry(self, model: str) -> None:
        c = self._retries.get(model)
        if c is None:
            c = self._retries[model] = _Counter()
        c.value += 1

    def migration(self, model: str, outcome: str) -> None:
        c = self._migrations.get((model, outcome))
        if c is None:
            c = self._migrations[(model, outcome)] = _Counter()
        c.value += 1

    def migrations_count(self, model: str, outcome: str) -> int:
        """How many broken streams of ``model`` ended with ``outcome`` (0 when none)."""
        c = self._migrations.get((model, outcome))
        return c.value if c is not None else 0

    def requests_count(self, model: str, status: int) -> int:
        """How many requests for ``model`` were answered with ``status`` (0 when none)."""
        c = self._req.get((model, status))
        return c.value if c is not None else 0

    def finished_counts(self) -> dict[str, int]:
        """Requests answered so far per model, any status."""
        out: dict[str, int] = {}
        for (model, _status), c in self._req.items():
            out[model] = out.get(model, 0) + c.value
        return out

    def ttft_counts(self) -> dict[str, list[int]]:
        """Each model's cumulative first-byte histogram (its bucket counts)."""
        return {m: list(h.counts) for m, h in self._ttft.items()}

    def retries_count(self, model: str) -> int:
        """How many retries were made for ``model`` (0 when none)."""
        c = self._retries.get(model)
        return c.value if c is not None else 0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
