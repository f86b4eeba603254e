"""A key that is not a valid KV key (only a raw publish on ``$KV.<bucket>.<key>`` makes one).

nats.py refuses to read such a key (InvalidKeyError), and the server lists it like any other. A
follower's full read stopped at it: every resync after it was cut short, and the first one, in
``start()``, failed outright, so a router (or any service following that bucket) could not start
while the key stood: one raw publish kept every router of the cluster down.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually


async def test_a_forged_key_is_skipped_and_the_other_keys_are_followed(
    nats_server: NatsServer, nc: NATS, prefix: str
) -> None:
    js = nc.jetstream()
    kv = await bus.ensure_kv(js, Subjects(prefix).bucket_keys)
    await kv.put("k1", b"one")
    await nc.publish(f"$KV.{Subjects(prefix).bucket_keys}.bad+key", b"forged")
    await kv.put("k2", b"two")
    await bus.flush(nc)
    seen: dict[str, bytes | None] = {}

    def on_change(key: str, value: bytes | None, rev: int) -> None:
        seen[key] = value

    f = KvFollower(kv, on_change, name="t", resync_s=0.2, retry_s=0.1)
    await asyncio.wait_for(f.start(), 10)
    try:
        assert seen == {"k1": b"one", "k2": b"two"}
        await kv.put("k3", b"three")
        await eventually(
            lambda: seen.get("k3") == b"three", timeout=5, every=0.02, what="the follower to see k3"
        )
        # The full reads go on past it (a value changed with no watch to tell is found by one).
        await f.resync()
        assert set(f.revisions) == {"k1", "k2", "k3"}
        assert all(not t.done() for t in f.tasks)
    finally:
        await f.stop()
