"""KvFollower's resync after a short key listing (what a cluster peer's death produced): a key is
dropped only when a direct read says it is gone. Found by the server-kill test: the router emptied its
API-key table on a resync about 30 s after the kill, and every request got 401."""

from __future__ import annotations

from typing import Any

from nats.js.errors import NoKeysError
from nats.js.kv import KeyValue

from llmgw_runtime import bus
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.settings import BusSettings


class ShortListing(KeyValue):
    """The bucket, except that its key listing comes back empty (the early end marker, nats.py #842)."""

    def __init__(self, kv: KeyValue) -> None:
        # The same bucket through the same JetStream context: every other call is the real one.
        super().__init__(kv._name, kv._stream, kv._pre, kv._js, kv._direct)

    async def keys(self, filters: list[str] | None = None, **kwargs: Any) -> list[str]:
        raise NoKeysError


async def test_short_listing_deletes_only_what_a_read_cannot_find(
    nats_server: NatsServer, prefix: str
) -> None:
    nc = await bus.connect(BusSettings(nats_urls=[nats_server.url], prefix=prefix), "follower-test")
    try:
        kv = await bus.ensure_kv(nc.jetstream(), f"{prefix}_short")
        await kv.put("a", b"1")
        await kv.put("b", b"2")
        seen: list[tuple[str, bytes | None]] = []
        f = KvFollower(kv, lambda k, v, r: seen.append((k, v)), resync_s=3600)
        await f.resync()
        assert sorted(seen) == [("a", b"1"), ("b", b"2")]
        seen.clear()
        await kv.delete("b")
        f.kv = ShortListing(kv)
        await f.resync()
        assert seen == [("b", None)], seen
        assert set(f.revisions) == {"a"}
    finally:
        await nc.close()
