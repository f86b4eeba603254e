"""A takeover that outlasts the lease TTL keeps the lease.

At 5,000 nodes on a loaded box, taking over (reading every replica record and assignment, one by one)
took longer than the TTL; the lease loop renewed only after it, found the key lapsed, stepped down and
took over again, in a loop: ctl went unanswered and "leadership lost" was logged every ~12 s.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.ctl import LeaseRecord
from llmgw_common.subjects import LEADER_KEY, Subjects
from llmgw_controlplane.apply import ReplicaStore
from llmgw_controlplane.leader import Lease, LeaseLost
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, start_cp
from tests.kit.cancels import swallows_one_cancel
from tests.kit.poll import eventually


@pytest.mark.slow
async def test_takeover_slower_than_the_ttl_keeps_the_lease(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    ttl = 1.0
    loads = 0
    real_load = ReplicaStore.load

    async def slow_load(self: ReplicaStore) -> object:
        nonlocal loads
        loads += 1
        await asyncio.sleep(3 * ttl)  # what thousands of sequential reads on a loaded box take
        return await real_load(self)

    monkeypatch.setattr(ReplicaStore, "load", slow_load)
    run = await start_cp(cp_settings(nats_server.url, prefix, lease_ttl_s=ttl))
    try:
        await eventually(lambda: run.cp.leader, timeout=15, what="the slow takeover to finish")
        assert run.cp.lease is not None
        first = run.cp.lease.fence
        # Three renewals after taking over: a lease that lapsed during the load is retaken instead (and
        # loaded again), so count the loads once the leader has renewed a few times.
        await eventually(
            lambda: run.cp.lease is not None and run.cp.lease.fence >= first + 3,
            timeout=15,
            what="three renewals after the takeover",
        )
        assert loads == 1
        assert run.cp.leader and run.cp.lease.held()
        kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_leader)
        rec, rev = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
        assert rec is not None and rec.holder == run.cp.holder and rev == run.cp.lease.fence
    finally:
        await run.stop()


async def test_lease_lost_during_a_takeover_abandons_it(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    loading = asyncio.Event()
    abandoned: list[bool] = []  # cp.leader when the load was cancelled

    async def stuck_load(self: ReplicaStore) -> object:
        loading.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            abandoned.append(run.cp.leader)
            raise
        raise AssertionError("unreachable")

    monkeypatch.setattr(ReplicaStore, "load", stuck_load)
    run = await start_cp(cp_settings(nats_server.url, prefix, lease_ttl_s=1.0))
    try:
        await asyncio.wait_for(loading.wait(), 15)
        # Another control plane holds the lease now (its write moves the revision under the renewal).
        kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_leader)
        await kv.put(LEADER_KEY, encode(LeaseRecord(holder="usurper", acquired_at=1.0, renewed_at=1.0)))
        await eventually(lambda: abandoned, what="the stuck takeover to be cancelled")
        assert abandoned == [False]  # never acted as leader on the way
        assert run.cp.lease is not None and not run.cp.lease.held()
    finally:
        await run.stop()


@pytest.mark.slow
async def test_lease_lost_ends_a_takeover_that_swallowed_a_cancel(bus_nc: NATS, prefix: str) -> None:
    """Python 3.11's asyncio.wait_for, in nats-py's request and so in every KV read of a takeover's load,
    drops a cancel that lands as its answer arrives (CPython gh-86296): a while_renewing() that cancelled
    the load once then waited for it for ever, and the lease loop neither led nor retried."""
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_leader, ttl=30.0)
    lease = Lease(kv, "a", ttl_s=0.6)
    assert await lease.step()
    # Another control plane holds the lease now: the first renewal under while_renewing() fails.
    await kv.put(LEADER_KEY, encode(LeaseRecord(holder="usurper", acquired_at=1.0, renewed_at=1.0)))

    # A state load whose KV read drops the first cancel.
    renewing = asyncio.create_task(lease.while_renewing(swallows_one_cancel()))
    try:
        # Not wait_for: it would cancel while_renewing(), whose gather would swallow that cancel too.
        done, _ = await asyncio.wait({renewing}, timeout=5)
        assert renewing in done
        assert isinstance(renewing.exception(), LeaseLost)
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
