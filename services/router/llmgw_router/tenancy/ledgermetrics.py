"""How far the usage ledger (ledger.py) is behind the answers, as Prometheus reads it at scrape time.

Nothing here runs per request: the figures are the writer's own (kept per wake and per write). A router
with no ledger (static mode, or the bus not reached yet: it has routed nothing) exports none of these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from llmgw_router.tenancy.ledger import Ledger


class LedgerMetrics(Collector):
    def __init__(self, ledger: Callable[[], Ledger | None]) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        ledger = self.ledger()
        if ledger is None:
            return
        yield GaugeMetricFamily(
            "llmgw_router_usage_ledger_failing",
            "1 while usage waits and the ledger's last try could not write it (a write failed or timed "
            "out, or the bus was away)",
            value=int(ledger.failing),
        )
        yield GaugeMetricFamily(
            "llmgw_router_usage_ledger_oldest_unwritten_seconds",
            "How long the oldest usage not yet in the usage ledger has waited (0: all written); it is "
            "lost if the router dies",
            value=ledger.oldest_unwritten_s(),
        )
        writes = CounterMetricFamily(
            "llmgw_router_usage_ledger_writes",
            "Usage ledger write batches (every hour changed since the last): ok, or failed (kept and retried)",
            labels=["outcome"],
        )
        writes.add_metric(["ok"], ledger.writes)
        writes.add_metric(["failed"], ledger.failed)
        yield writes
