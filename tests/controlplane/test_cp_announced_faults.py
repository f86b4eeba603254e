"""The announced node state when its bucket or the events stream is away (review findings 1 and 2).

One control plane in-process on a fake clock against the session's nats-server. The announced bucket
is a stream of its own: an election or a timeout there must not stop placement and routing. Events
dropped while the events stream alone is away must be republished, not cleared from the record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.announced import ANNOUNCED_NODES_KEY, AnnouncedNodes
from llmgw_common.codec import encode
from llmgw_common.subjects import LEADER_KEY, Subjects
from llmgw_controlplane.events import EventPublisher
from llmgw_controlplane.service import ControlPlane
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings
from tests.controlplane.test_cp_announced_nodes import LOST_S, Clock, _heard, _node_events
from tests.kit.agents import FakeAgent
from tests.kit.poll import eventually


@pytest.fixture
async def leading(nats_server: NatsServer, prefix: str) -> AsyncIterator[tuple[ControlPlane, Clock]]:
    clock = Clock(time.time())
    s = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=LOST_S)
    nc = await bus.connect(s, "cp-a", wait=False)
    cp = ControlPlane(s, nc, holder="cp-a", clock=clock)
    await cp.start()
    try:
        assert await cp.lease.step()
        await cp._become_leader()
        await cp._tick(clock())
        yield cp, clock
    finally:
        await cp.leadership.release()
        await cp.close()
        await nc.close()


async def _record(nc: NATS, prefix: str) -> tuple[AnnouncedNodes | None, int]:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_announced)
    return await bus.kv_get(kv, ANNOUNCED_NODES_KEY, AnnouncedNodes)


async def _beating(nc: NATS, prefix: str, cp: ControlPlane, *nodes: str) -> None:
    for n in nodes:
        await FakeAgent(nc, prefix, n).beat()
    await eventually(lambda: all(_heard(cp, n) for n in nodes), what=f"{nodes} heard")


async def test_the_pass_goes_on_while_the_announced_bucket_is_away(
    leading: tuple[ControlPlane, Clock], bus_nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    cp, clock = leading
    await _beating(bus_nc, prefix, cp, "gpu-0")
    await cp._tick(clock())
    subj = Subjects(prefix)
    await bus_nc.jetstream().delete_stream(f"KV_{subj.bucket_announced}")
    passes = cp.loop.passes
    clock.t += LOST_S + 1  # gpu-0 lost: the record must be written, and cannot be
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        for _ in range(3):
            await cp._tick(clock())
    assert cp.loop.passes == passes + 3, "a pass was skipped for the announced bucket alone"
    said = [r.getMessage() for r in caplog.records if "node events not announced" in r.getMessage()]
    assert len(said) == 1, f"once per streak, not per pass: {said}"
    # Back: the difference is announced then, not lost.
    await bus.ensure_kv(bus_nc.jetstream(), subj.bucket_announced, direct=False)
    await cp._tick(clock())
    assert await _node_events(bus_nc, prefix) == [("node.lost", "gpu-0")]


async def test_a_steady_tenure_does_not_rewrite_the_record_for_each_renewal(
    leading: tuple[ControlPlane, Clock], bus_nc: NATS, prefix: str
) -> None:
    cp, clock = leading
    first, rev = await _record(bus_nc, prefix)
    # A tenure's first pass stamps its fence (the pass's own confirm may renew the lease right after).
    assert first is not None and 0 < first.fence <= cp.lease.fence
    for _ in range(3):
        before = cp.lease.fence
        assert await cp.lease.step()
        assert cp.lease.fence > before, "the premise: each renewal moves the lease's revision"
        await cp._tick(clock())
    assert await _record(bus_nc, prefix) == (first, rev), "rewritten with nothing new"
    # A write that carries a change stamps the fence of the moment.
    await _beating(bus_nc, prefix, cp, "gpu-0")
    await cp._tick(clock())
    clock.t += LOST_S + 1
    await cp._tick(clock())
    now, _ = await _record(bus_nc, prefix)
    assert now is not None and set(now.lost) == {"gpu-0"} and first.fence < now.fence <= cp.lease.fence


@pytest.mark.slow
async def test_node_events_dropped_while_only_the_events_stream_is_away_are_republished(
    leading: tuple[ControlPlane, Clock], bus_nc: NATS, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp, clock = leading
    # The queue's bound, made small so that two node events overflow it (it is 1000).
    monkeypatch.setattr(EventPublisher, "MAX_PENDING", 1)
    await _beating(bus_nc, prefix, cp, "gpu-0", "gpu-1")
    await cp._tick(clock())
    subj = Subjects(prefix)
    js = bus_nc.jetstream()
    await js.delete_stream(subj.events_stream)
    clock.t += LOST_S + 1
    await cp._tick(clock())  # both lost: recorded, their events queued, the oldest dropped
    assert cp.loop.events.dropped >= 1
    await cp._tick(clock())
    await bus.ensure_stream(js, subj.events_stream, [subj.all_events()], max_age_s=3600.0)
    for _ in range(3):
        await cp._tick(clock())
    assert sorted(await _node_events(bus_nc, prefix)) == [("node.lost", "gpu-0"), ("node.lost", "gpu-1")]
    rec, _ = await _record(bus_nc, prefix)
    assert rec is not None and rec.unsent == (), "all published: the record's unsent cleared"


async def test_a_record_fenced_above_our_held_lease_is_overwritten_not_obeyed(
    leading: tuple[ControlPlane, Clock], bus_nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The leader bucket made again by an operator: its revisions begin again, below the record's
    fence. Obeyed, every tick raised Fenced and the leader stepped down for good, logging that another
    control plane leads."""
    cp, clock = leading
    kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_announced)
    high = 10**9
    await kv.put(ANNOUNCED_NODES_KEY, encode(AnnouncedNodes(fence=high, lost={"old": clock.t})))
    await cp._step_down()
    assert await cp.lease.step()
    await cp._become_leader()  # a new tenure reads the record afresh
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        for _ in range(3):
            await cp._tick(clock())
    assert cp.leader, "stepped down for a fence no live control plane holds"
    said = [r for r in caplog.records if "leader bucket was made again" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.ERROR]
    assert not [r for r in caplog.records if "another control plane leads" in r.getMessage()]
    rec, _ = await _record(bus_nc, prefix)
    assert rec is not None and rec.fence <= cp.lease.fence and rec.lost == {"old": clock.t}


async def test_a_record_fenced_above_a_lost_lease_still_steps_down(
    leading: tuple[ControlPlane, Clock], bus_nc: NATS, prefix: str
) -> None:
    cp, clock = leading
    kv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_announced)
    await kv.put(ANNOUNCED_NODES_KEY, encode(AnnouncedNodes(fence=10**9)))
    cp.loop.announced.new_tenure()
    # A successor took the lease: ours cannot be confirmed.
    lkv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_leader)
    await lkv.put(LEADER_KEY, b"{}")
    await cp._tick(clock())
    assert not cp.leader
    rec, _ = await _record(bus_nc, prefix)
    assert rec is not None and rec.fence == 10**9, "a stale leader overwrote its successor's record"
