"""A control plane on a server that cannot reach the lease bucket moves to another server (issue 22,
case 4b): on a nats-server cut from its peers the lease calls fail (JetStream 503) while the server
still answers pings, so the client would stay; with both control planes there, none led until the heal.

In-process, without namespaces: the "island" is a second nats-server that lacks the bucket (every
lease call fails, as on a cut server), listed first; the session's server holds the bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from llmgw_common.subjects import Subjects
from llmgw_controlplane.leader import Lease
from llmgw_controlplane.leadership import leave_if_stranded
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually

TTL = 2.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def island(tmp_path: Path) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "island")
    srv.start()
    yield srv
    srv.stop()


async def _on(servers: list[str]) -> NATS:
    return await nats.connect(
        servers=servers, dont_randomize=True, max_reconnect_attempts=-1, reconnect_time_wait=0.1
    )


def _lease(nc: NATS, prefix: str, clock: Clock) -> Lease:
    b = Subjects(prefix).bucket_leader
    # Bound by hand: binding reads the stream's info, which the island cannot give either.
    kv = KeyValue(name=b, stream=f"KV_{b}", pre=f"$KV.{b}.", js=nc.jetstream(), direct=True)
    return Lease(kv, "cp-x", TTL, clock=clock)


async def test_a_lease_unanswered_for_a_ttl_moves_the_client_to_another_server(
    nats_server: NatsServer, island: NatsServer, prefix: str
) -> None:
    setup = await nats.connect(nats_server.url)
    await bus.ensure_kv(setup.jetstream(), Subjects(prefix).bucket_leader, ttl=30.0)
    await setup.close()
    clock = Clock()
    nc = await _on([island.url, nats_server.url])
    try:
        assert nc.connected_url is not None and nc.connected_url.port == island.port
        lease = _lease(nc, prefix, clock)
        assert not await lease.step()
        assert lease.failing_since == clock.t
        clock.t += TTL / 2
        assert not await lease.step()
        assert not await leave_if_stranded(lease, nc), "moved before a whole TTL unanswered"
        clock.t += TTL / 2
        assert await leave_if_stranded(lease, nc)
        await eventually(
            lambda: nc.connected_url is not None and nc.connected_url.port == nats_server.port,
            what="the client on the server that holds the bucket",
        )
        assert await lease.step(), "the lease was not taken from the other server"
        assert lease.failing_since is None
    finally:
        await nc.close()


async def test_with_one_server_there_is_nowhere_to_go(island: NatsServer, prefix: str) -> None:
    clock = Clock()
    nc = await _on([island.url])
    try:
        lease = _lease(nc, prefix, clock)
        assert not await lease.step()
        clock.t += 10 * TTL
        assert not await leave_if_stranded(lease, nc)
        assert nc.is_connected
    finally:
        await nc.close()


async def test_a_refusal_is_an_answer(nats_server: NatsServer, prefix: str) -> None:
    """Another holder's lease refuses ours: that server reaches the bucket, nothing to leave."""
    nc = await nats.connect(nats_server.url)
    try:
        kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_leader, ttl=30.0)
        clock = Clock()
        assert await Lease(kv, "holder", TTL, clock=clock).step()
        other = Lease(kv, "standby", TTL, clock=clock)
        assert not await other.step()
        assert other.failing_since is None
        clock.t += 10 * TTL
        assert not await leave_if_stranded(other, nc)
    finally:
        await nc.close()
