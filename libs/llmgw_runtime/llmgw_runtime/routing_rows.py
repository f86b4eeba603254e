"""Reading the routing table as stored in ``<prefix>_routing`` (rows, or the legacy whole value), for
whoever reads it once rather than following it: a control plane at a takeover, tests, tools."""

from __future__ import annotations

import asyncio

from nats.js.kv import KeyValue

from llmgw_common.messages import RoutingEndpoints
from llmgw_common.routing_table import ROUTING_HEAD, ModelRouting, RoutingHead, RowFold, row_model
from llmgw_common.subjects import ROUTING_ENDPOINTS
from llmgw_runtime.bus import DropLog, kv_get, kv_keys

# Gets in flight at once while reading every row (thousands at a takeover: one by one took seconds).
_READS_IN_FLIGHT = 64


async def read_rows(kv: KeyValue, drops: DropLog | None = None) -> tuple[RowFold, RoutingEndpoints | None]:
    """The rows and head folded, and the legacy ``endpoints`` value if the bucket still holds one."""
    keys = await kv_keys(kv)
    fold = RowFold()
    legacy: RoutingEndpoints | None = None
    gate = asyncio.Semaphore(_READS_IN_FLIGHT)

    async def one(key: str) -> None:
        nonlocal legacy
        async with gate:
            if key == ROUTING_ENDPOINTS:
                legacy, _ = await kv_get(kv, key, RoutingEndpoints, drops)
            elif key == ROUTING_HEAD:
                head, _ = await kv_get(kv, key, RoutingHead, drops)
                if head is not None:
                    fold.set_head(head)
            elif row_model(key) is not None:
                row, _ = await kv_get(kv, key, ModelRouting, drops)
                if row is not None:
                    fold.put(row)

    await asyncio.gather(*(one(k) for k in keys))
    return fold, legacy


async def read_routing(kv: KeyValue, drops: DropLog | None = None) -> RoutingEndpoints | None:
    """The routing table as a router holds it: the rows folded, else the legacy whole value, else None
    (no table yet)."""
    fold, legacy = await read_rows(kv, drops)
    if fold.read:
        return fold.table()
    return legacy
