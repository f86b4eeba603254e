"""The parts of routing by cached prefix, built and run together: what the router's wiring holds.

``CacheService.routing`` is the request path's facade (``router.py``); the rest runs beside it: the
follower keeping the exact index (``follower.py``) and the tokenizer store (``tokenizers.py``). The
wiring calls :meth:`CacheService.routing_changed` when the routing table changes, and
:meth:`CacheService.report` for each model's operator figures (``ModelCache``, in the demand report).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nats.aio.client import Client as NATS

from llmgw_common.catalog import ModelProfile
from llmgw_common.router_messages import ModelCache
from llmgw_common.subjects import Subjects
from llmgw_router.cache.approx import DEFAULT_TTL_S, ApproxIndex
from llmgw_router.cache.follower import KvEventFollower
from llmgw_router.cache.index import DEFAULT_MAX_ENTRIES, KvIndex
from llmgw_router.cache.router import CacheLimits, PrefixRouting
from llmgw_router.cache.tokenizers import TokenizerStore


class CacheService:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        nodes: Callable[[], Iterable[str]],
        models: Callable[[], Iterable[str]],
        limits: CacheLimits | None = None,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        approx_ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        """``nodes()``: the nodes holding an endpoint in the routing table; ``models()``: the catalog's."""
        self.index = KvIndex(max_entries)
        self.follower = KvEventFollower(nc, subjects, self.index, nodes)
        self.tokenizers = TokenizerStore(nc.jetstream(), subjects, models)
        self.routing = PrefixRouting(
            self.index, self.tokenizers, limits, ApproxIndex(ttl_s=approx_ttl_s), lag=self.follower
        )

    async def start(self) -> None:
        await self.follower.start()
        await self.tokenizers.start()

    async def stop(self) -> None:
        await self.tokenizers.stop()
        await self.follower.stop()

    def routing_changed(self, profiles: Iterable[ModelProfile], replicas: Iterable[str]) -> None:
        """The routing table changed: the catalog's modes, replicas gone from both indexes, tokenizers of
        new models looked for now."""
        self.routing.set_catalog(profiles)
        keep = set(replicas)
        self.follower.retain(keep)
        self.routing.retain(keep)
        self.tokenizers.kick()

    def report(self, model: str, engine_queries: float = 0.0, engine_hits: float = 0.0) -> ModelCache | None:
        """The model's figures since this router started, or None for a model not in the catalog.
        ``engine_*``: the engines' own prefix-cache counters, summed over the model's load reports."""
        st = self.routing.stats().get(model)
        if st is None:
            return None
        lag = self.routing.event_lag_ms(model)
        return ModelCache(
            mode=st.mode.value,
            prompt_tokens=st.prompt_tokens,
            predicted_hit_tokens=st.predicted_hit_tokens,
            engine_queries=engine_queries,
            engine_hits=engine_hits,
            index_blocks=self.routing.index_blocks(model),
            event_lag_ms=lag,
        )
