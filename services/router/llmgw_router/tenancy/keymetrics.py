"""Per-key counters on the router's /metrics with bounded label cardinality: requests, prompt and
completion tokens of at most ``top_n`` keys by name, every other key summed under ``key="_other"``.

Read at scrape time from the usage table (usage.py: counts since this router started), so the request
path pays nothing. The labelled keys are the busiest when a slot was free, and they keep their label
for the router's life: a counter must only grow, and a key moved back into ``_other`` would make both
series jump. A cluster's exact per-key numbers are ``llmgw keys usage`` (the durable ledger); these are
for dashboards and alerts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.usage import UsageTable

OTHER = "_other"
TOP_N = 20


class KeyUsageMetrics(Collector):
    def __init__(self, usage: UsageTable, keys: KeyTable, top_n: int = TOP_N) -> None:
        self.usage, self.keys, self.top_n = usage, keys, top_n
        self.labelled: dict[str, str] = {}  # key id -> its name when it got its label

    def _totals(self) -> dict[str, tuple[int, int, int]]:
        out: dict[str, tuple[int, int, int]] = {}
        for kid, per_model in self.usage.usage.items():
            r = p = c = 0
            for row in per_model.values():
                r, p, c = r + row[0], p + row[1], c + row[2]
            out[kid] = (r, p, c)
        return out

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = self._totals()
        free = self.top_n - len(self.labelled)
        if free > 0:
            fresh = [k for k in totals if k not in self.labelled]
            fresh.sort(key=lambda k: (-(totals[k][1] + totals[k][2]), -totals[k][0], k))
            for kid in fresh[:free]:
                rec = self.keys.by_id(kid)
                self.labelled[kid] = rec.name if rec is not None else kid
        fams = [
            CounterMetricFamily(f"llmgw_router_key_{what}", doc, labels=["key", "name"])
            for what, doc in (
                ("requests", "Requests answered per API key (top keys; the rest under key=_other)"),
                ("prompt_tokens", "Prompt tokens per API key (top keys; the rest under key=_other)"),
                ("completion_tokens", "Completion tokens per API key (top keys; the rest under key=_other)"),
            )
        ]
        other = [0, 0, 0]
        for kid, t in totals.items():
            name = self.labelled.get(kid)
            if name is None:
                other = [other[i] + t[i] for i in range(3)]
                continue
            for fam, v in zip(fams, t, strict=True):
                fam.add_metric([kid, name], v)
        if len(totals) > len(self.labelled) or any(other):
            for fam, v in zip(fams, other, strict=True):
                fam.add_metric([OTHER, OTHER], v)
        yield from fams
