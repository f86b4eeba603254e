"""``<prefix>_routing``: the catalog, and the routing table as one row per model (issue 35).

Each pass hands :meth:`RoutingPublisher.publish_endpoints` the whole table; the publisher compares it
model by model with what it last wrote and writes only the rows that changed (and deletes the rows of
models that left it), so a change costs the bus and every router that model's row, never the table: a
row is a model's endpoints (~140 bytes each), the table at 20,000 endpoints was 2.8 MB, past NATS's
1 MB ``max_payload``. The format is ``llmgw_common.routing_table``; docs/bus.md describes it.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.js.kv import KeyValue

from llmgw_common.catalog import Catalog
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingCatalog
from llmgw_common.routing_table import ROUTING_HEAD, ModelRouting, RoutingHead, row_key
from llmgw_common.subjects import ROUTING_CATALOG, ROUTING_ENDPOINTS
from llmgw_runtime.bus import DropLog, kv_get
from llmgw_runtime.routing_rows import read_rows

log = logging.getLogger("llmgw.controlplane.apply")

# One model's row: its endpoints, why it has none ready, what is coming, scaled to zero.
RowContent = tuple[tuple[Endpoint, ...], str | None, str | None, bool]

# Row writes in flight at once (a takeover may write thousands; one by one, each waits its ack).
_WRITES_IN_FLIGHT = 64


class RoutingPublisher:
    """``catalog`` and the rows of the routing table, each rewritten only when its content changes."""

    def __init__(self, kv: KeyValue, drops: DropLog) -> None:
        self.kv = kv
        self.drops = drops
        self.endpoints_version = 0
        self.catalog_version = 0
        # Model -> the content of its row as last written or loaded; None while there is no table.
        self._rows: dict[str, RowContent] | None = None
        # A head is written with the first table published, unless the bucket holds one (see load()).
        self._head_written = False
        # The bucket still holds a whole table under the old key: removed once the rows are written; and
        # its cold models until then.
        self._legacy = False
        self._legacy_cold: tuple[str, ...] | None = None
        self._catalog: Catalog | None = None
        # What publishing cost, for the fleet bench: rows written or deleted, and their bytes.
        self.row_writes = 0
        self.row_bytes = 0

    async def load(self) -> None:
        """Continue the table and the versions already in the bucket, so routers see versions only grow."""
        fold, legacy = await read_rows(self.kv, self.drops)
        # A head says only that a table exists (and its format): one stored stays, so a takeover whose
        # table is the same as its predecessor's writes nothing (versions stay put).
        self._head_written = fold.head is not None
        # The rows as stored (a migration cut short may have left some beside a legacy table).
        self._rows = (
            {m: (r.endpoints, r.unavailable, r.coming, r.cold) for m, r in fold.rows.items()}
            if fold.rows or fold.head is not None
            else None
        )
        self.endpoints_version = max(fold.version, 0)
        self._legacy = legacy is not None
        self._legacy_cold = None
        if legacy is not None:
            # Written by a control plane from before the rows: routers hold it until this one's head.
            self.endpoints_version = max(self.endpoints_version, legacy.version)
            if fold.head is None:
                self._legacy_cold = tuple(sorted(legacy.cold))
        cat, _ = await kv_get(self.kv, ROUTING_CATALOG, RoutingCatalog, self.drops)
        if cat is not None:
            self.catalog_version = cat.version
            self._catalog = cat.catalog

    @property
    def stored_cold(self) -> tuple[str, ...] | None:
        """The models scaled to zero in the table last written or loaded (a takeover keeps them); None
        when there is no table yet."""
        if self._legacy_cold is not None:
            return self._legacy_cold
        if self._rows is None:
            return None
        return tuple(sorted(m for m, c in self._rows.items() if c[3]))

    async def publish_endpoints(
        self,
        endpoints: dict[str, tuple[Endpoint, ...]],
        unavailable: dict[str, str],
        coming: dict[str, str] | None = None,
        cold: tuple[str, ...] = (),
    ) -> bool:
        coming = coming or {}
        cold_set = set(cold)
        # Over a legacy whole table every row is written: readers hold that table until the head.
        old = {} if self._legacy else (self._rows or {})
        new: dict[str, RowContent] = {
            m: (endpoints.get(m, ()), unavailable.get(m), coming.get(m), m in cold_set)
            for m in set(endpoints) | set(unavailable) | set(coming) | cold_set
        }
        changed = [m for m, c in new.items() if old.get(m) != c]
        gone = [m for m in (self._rows or {}) if m not in new]
        first = self._rows is None or not self._head_written
        if not changed and not gone and not first and not self._legacy:
            return False
        version = self.endpoints_version + 1
        rows = self._rows = dict(self._rows or {})
        gate = asyncio.Semaphore(_WRITES_IN_FLIGHT)

        async def put(m: str) -> None:
            eps, why, what, is_cold = new[m]
            row = ModelRouting(
                version=version, model=m, endpoints=eps, unavailable=why, coming=what, cold=is_cold
            )
            data = encode(row)
            async with gate:
                await self.kv.put(row_key(m), data)
            rows[m] = new[m]
            self.row_writes += 1
            self.row_bytes += len(data)

        async def delete(m: str) -> None:
            async with gate:
                await self.kv.delete(row_key(m))
            rows.pop(m, None)
            self.row_writes += 1

        results = await asyncio.gather(
            *(put(m) for m in changed), *(delete(m) for m in gone), return_exceptions=True
        )
        # A row not written keeps its old content here, so the next pass writes it again.
        self.endpoints_version = version
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        if first:
            # After the rows: a router that sees the head finds the rows it announces.
            await self.kv.put(ROUTING_HEAD, encode(RoutingHead(version=version, models=len(rows))))
            self._head_written = True
        self._legacy_cold = None
        if self._legacy:
            try:
                await self.kv.delete(ROUTING_ENDPOINTS)
            except nats.errors.Error as e:
                log.warning("could not delete the old whole routing table: %s", e)
            else:
                self._legacy = False
        return True

    async def publish_catalog(self, catalog: Catalog) -> bool:
        if self._catalog == catalog:
            return False
        version = self.catalog_version + 1
        await self.kv.put(ROUTING_CATALOG, encode(RoutingCatalog(version=version, catalog=catalog)))
        self.catalog_version = version
        self._catalog = catalog
        return True
