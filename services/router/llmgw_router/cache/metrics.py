"""Routing by cached prefix on the router's /metrics, read at scrape time (nothing on the request path).

Per model: what the router predicted (prompt tokens, and those it expected cached where it sent them)
against what the engines report (``vllm:prefix_cache_*``, summed from the agents' load reports), the
index's size, and how old relayed events were on arrival; requests routed by load alone, and why;
the follower's batches, snapshots and drops; the tokenizers loaded and failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw_router.cache.service import CacheService


class CacheMetrics(Collector):
    def __init__(
        self, service: Callable[[], CacheService | None], engines: Callable[[str], tuple[float, float]]
    ) -> None:
        """``service()``: the cache service, None before the bus is reached; ``engines(model)``: the
        engines' own (queries, hits) counters in tokens."""
        self.service = service
        self.engines = engines

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cs = self.service()
        if cs is None:
            return
        routing = cs.routing
        prompt = CounterMetricFamily(
            "llmgw_router_prefix_prompt_tokens",
            "Prompt tokens of the requests this router routed by cached prefix",
            labels=["model"],
        )
        predicted = CounterMetricFamily(
            "llmgw_router_prefix_predicted_hit_tokens",
            "Of those, the tokens this router expected cached on the replica it chose",
            labels=["model"],
        )
        engine_q = CounterMetricFamily(
            "llmgw_router_engine_prefix_queries_tokens",
            "Prompt tokens the model's engines looked up in their prefix caches (their own counters, "
            "summed over the load reports this router holds)",
            labels=["model"],
        )
        engine_h = CounterMetricFamily(
            "llmgw_router_engine_prefix_hits_tokens",
            "Of those, the tokens the engines found cached",
            labels=["model"],
        )
        by_load = CounterMetricFamily(
            "llmgw_router_prefix_unrouted",
            "Requests of a model routed by cached prefix that went by load alone: no_tokenizer (not yet "
            "loaded), no_block_size (no replica reported blocks yet), unpredictable (media, tools, ...)",
            labels=["model", "reason"],
        )
        blocks = GaugeMetricFamily(
            "llmgw_router_kv_index_blocks", "Blocks in this router's KV index for the model", labels=["model"]
        )
        lag = GaugeMetricFamily(
            "llmgw_router_kv_event_lag_seconds",
            "Age of the newest relayed KV-event batch on arrival (agent's clock to this router's)",
            labels=["model"],
        )
        for model, st in routing.stats().items():
            prompt.add_metric([model], st.prompt_tokens)
            predicted.add_metric([model], st.predicted_hit_tokens)
            q, h = self.engines(model)
            engine_q.add_metric([model], q)
            engine_h.add_metric([model], h)
            by_load.add_metric([model, "no_tokenizer"], st.no_tokenizer)
            by_load.add_metric([model, "no_block_size"], st.no_block_size)
            by_load.add_metric([model, "unpredictable"], st.unpredictable)
            blocks.add_metric([model], routing.index_blocks(model))
            ms = routing.event_lag_ms(model)
            if ms is not None:
                lag.add_metric([model], ms / 1000.0)
        yield from (prompt, predicted, engine_q, engine_h, by_load, blocks, lag)
        f, t = cs.follower, cs.tokenizers
        events = CounterMetricFamily(
            "llmgw_router_kv_events",
            "Relayed KV-event traffic: batches applied, snapshots taken, snapshots failed, messages "
            "dropped (undecodable, or naming another node than their subject's)",
            labels=["what"],
        )
        events.add_metric(["batches"], f.batches)
        events.add_metric(["snapshots"], f.snapshots)
        events.add_metric(["snapshot_failures"], f.snapshot_failures)
        events.add_metric(["dropped"], f.undecodable)
        yield events
        tok = CounterMetricFamily(
            "llmgw_router_tokenizer_loads",
            "Tokenizers loaded from the object store, and versions that could not be used",
            labels=["outcome"],
        )
        tok.add_metric(["loaded"], t.loads)
        tok.add_metric(["failed"], t.failures)
        yield tok
