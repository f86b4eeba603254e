"""``<prefix>_routing``: the catalog and the routing table, rewritten only when their content changes
(moved from apply.py; issue 35 makes the table one row per model)."""

from __future__ import annotations

from nats.js.kv import KeyValue

from llmgw_common.catalog import Catalog
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints
from llmgw_common.subjects import ROUTING_CATALOG, ROUTING_ENDPOINTS
from llmgw_runtime.bus import DropLog, kv_get


class RoutingPublisher:
    """``<prefix>_routing`` keys ``endpoints`` and ``catalog``, rewritten only when their content changes."""

    def __init__(self, kv: KeyValue, drops: DropLog) -> None:
        self.kv = kv
        self.drops = drops
        self.endpoints_version = 0
        self.catalog_version = 0
        self._endpoints: (
            tuple[dict[str, tuple[Endpoint, ...]], dict[str, str], dict[str, str], tuple[str, ...]] | None
        ) = None
        self._catalog: Catalog | None = None

    async def load(self) -> None:
        """Continue the versions already in the bucket, so routers see them only grow."""
        ep, _ = await kv_get(self.kv, ROUTING_ENDPOINTS, RoutingEndpoints, self.drops)
        if ep is not None:
            self.endpoints_version = ep.version
            self._endpoints = (dict(ep.endpoints), dict(ep.unavailable), dict(ep.coming), tuple(ep.cold))
        cat, _ = await kv_get(self.kv, ROUTING_CATALOG, RoutingCatalog, self.drops)
        if cat is not None:
            self.catalog_version = cat.version
            self._catalog = cat.catalog

    @property
    def stored_cold(self) -> tuple[str, ...] | None:
        """The models scaled to zero in the table last written or loaded (a takeover keeps them); None
        when there is no table yet."""
        return self._endpoints[3] if self._endpoints is not None else None

    async def publish_endpoints(
        self,
        endpoints: dict[str, tuple[Endpoint, ...]],
        unavailable: dict[str, str],
        coming: dict[str, str] | None = None,
        cold: tuple[str, ...] = (),
    ) -> bool:
        content = (endpoints, unavailable, coming or {}, cold)
        if self._endpoints == content:
            return False
        version = self.endpoints_version + 1
        msg = RoutingEndpoints(
            version=version, endpoints=endpoints, unavailable=unavailable, coming=coming or {}, cold=cold
        )
        await self.kv.put(ROUTING_ENDPOINTS, encode(msg))
        self.endpoints_version = version
        self._endpoints = content
        return True

    async def publish_catalog(self, catalog: Catalog) -> bool:
        if self._catalog == catalog:
            return False
        version = self.catalog_version + 1
        await self.kv.put(ROUTING_CATALOG, encode(RoutingCatalog(version=version, catalog=catalog)))
        self.catalog_version = version
        self._catalog = catalog
        return True
