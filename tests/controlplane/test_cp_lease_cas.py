"""The lease's compare-and-set against itself: a renewal racing a confirm, a renewal whose reply was lost.

Neither may depose the holder (at 5,000 nodes a pass's confirm() met the lease loop's step() on the
same revision and the leader stepped down for a TTL); a genuine other holder still must.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from llmgw_common.codec import encode
from llmgw_common.ctl import LeaseRecord
from llmgw_common.subjects import LEADER_KEY, Subjects
from llmgw_controlplane.leader import Lease
from llmgw_runtime import bus
from tests.kit.poll import eventually


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _leader_kv(nc: NATS, prefix: str) -> KeyValue:
    return await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_leader, ttl=30.0)


async def _land_renewal_unseen(kv: KeyValue) -> int:
    """What a renewal whose reply timed out (or whose task was cancelled) leaves: the holder's own record
    at a new revision that the holder never learnt."""
    rec, rev = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    assert rec is not None
    return await kv.update(LEADER_KEY, encode(rec.model_copy(update={"renewed_at": time.time()})), last=rev)


async def test_lease_renewal_racing_confirm_kept(bus_nc: NATS, prefix: str) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    a = Lease(kv, "a", ttl_s=10.0)
    assert await a.step()
    for _ in range(20):
        # The lease loop's step() and a pass's confirm() (and another step) in flight at once.
        assert list(await asyncio.gather(a.step(), a.confirm(), a.step())) == [True, True, True]
    assert a.held()
    _, rev = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    assert a.fence == rev  # the last write is the one the holder knows of


async def test_lease_racing_renewals_yield_to_takeover(
    bus_nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    ca, cb = Clock(), Clock()
    a = Lease(kv, "a", ttl_s=10.0, clock=ca)
    b = Lease(kv, "b", ttl_s=10.0, clock=cb)
    assert await a.step()
    assert not await b.step()
    cb.t += 10.1  # a silent for a whole TTL by b's clock: b takes over
    assert await b.step()
    assert list(await asyncio.gather(a.step(), a.confirm())) == [False, False]
    assert not a.held()
    assert "leadership lost (b holds the lease)" in caplog.messages
    rec, rev = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    assert rec is not None and rec.holder == "b" and rev == b.fence  # a wrote nothing over b


async def test_lease_renewal_reply_lost_kept(bus_nc: NATS, prefix: str) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    a = Lease(kv, "a", ttl_s=10.0)
    assert await a.step()
    landed = await _land_renewal_unseen(kv)
    assert await a.step()
    assert a.held() and a.fence > landed


async def test_lease_same_name_other_tenure_deposes(bus_nc: NATS, prefix: str) -> None:
    # Holder names are hostname-pid: a restarted container can reuse one. Only this tenure's own
    # record (same acquired_at) counts as ours.
    kv = await _leader_kv(bus_nc, prefix)
    a = Lease(kv, "cp-1", ttl_s=10.0)
    assert await a.step()
    _, rev = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    other = LeaseRecord(holder="cp-1", acquired_at=time.time() + 1.0, renewed_at=time.time() + 1.0)
    await kv.update(LEADER_KEY, encode(other), last=rev)
    assert not await a.step()
    assert not a.held()
    rec, _ = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    assert rec == other


async def test_lease_release_after_lost_reply_frees_key(bus_nc: NATS, prefix: str) -> None:
    # Shutting down cancels a pass mid-confirm; its renewal may land unseen. The release must still
    # free the key, or a standby waits a whole TTL.
    kv = await _leader_kv(bus_nc, prefix)
    a = Lease(kv, "a", ttl_s=10.0)
    b = Lease(kv, "b", ttl_s=10.0)
    assert await a.step()
    await _land_renewal_unseen(kv)
    await a.release()
    assert not a.held()
    assert await b.step()


async def test_lease_release_waits_for_renewal(bus_nc: NATS, prefix: str) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    a = Lease(kv, "a", ttl_s=10.0)
    b = Lease(kv, "b", ttl_s=10.0)
    assert await a.step()
    await asyncio.gather(a.confirm(), a.release())
    assert not a.held()  # the renewal that finished first does not bring the lease back
    assert await b.step()


async def test_lease_release_spares_successor(bus_nc: NATS, prefix: str) -> None:
    kv = await _leader_kv(bus_nc, prefix)
    ca, cb = Clock(), Clock()
    a = Lease(kv, "a", ttl_s=10.0, clock=ca)
    b = Lease(kv, "b", ttl_s=10.0, clock=cb)
    assert await a.step()
    assert not await b.step()
    cb.t += 10.1
    assert await b.step()
    await a.release()  # a still thinks it holds the lease: its delete must not remove b's
    rec, rev = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    assert rec is not None and rec.holder == "b" and rev == b.fence


@pytest.mark.slow
async def test_lease_lapsed_key_is_named_as_such(
    bus_nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A lone control plane that could not renew for a TTL must not blame "another control plane".
    kv = await bus.ensure_kv(bus_nc.jetstream(), Subjects(prefix).bucket_leader, ttl=1.0)
    c = Clock()
    a = Lease(kv, "a", ttl_s=1.0, clock=c)
    assert await a.step()
    await eventually(lambda: _gone(kv), what="the bucket's TTL to remove the unrenewed key")
    c.t += 2.5
    assert not await a.step()
    assert "leadership lost (the lease lapsed (TTL 1s, not renewed for 2.5s))" in caplog.messages


async def _gone(kv: KeyValue) -> bool:
    rec, _ = await bus.kv_get(kv, LEADER_KEY, LeaseRecord)
    return rec is None
