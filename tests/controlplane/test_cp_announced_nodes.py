"""Node events across a change of leader (issue 22, finding 1): the next leader announces what no
leader said in the gap, once, from the cluster's announced state in ``<prefix>_announced``.

Before, a standby judged a node lost (or back) in the gap and dropped its event; the leader after it
had nothing to say, because the transition was already behind its own detector. Two control planes
in-process on a fake clock against the session's nats-server; the lease handed over by hand.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.announced import ANNOUNCED_NODES_KEY, AnnouncedNodes, NodeTurn
from llmgw_common.codec import decode
from llmgw_common.messages import Event
from llmgw_common.subjects import Subjects
from llmgw_controlplane.announcements import AnnouncedStore, Judged, missed
from llmgw_controlplane.apply import Fenced
from llmgw_controlplane.scheduler.snapshot import NodeState
from llmgw_controlplane.service import ControlPlane
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings
from tests.kit.agents import FakeAgent
from tests.kit.poll import eventually

LOST_S = 5.0


def _j(lost: tuple[str, ...] = (), ready: tuple[str, ...] = (), silent: tuple[str, ...] = ()) -> Judged:
    """``silent``: judged ready, but no heartbeat came within node_lost_s."""
    return Judged(lost=frozenset(lost), known={*lost, *ready, *silent}, reporting=lambda n: n not in silent)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- the rule, pure


def test_missed_says_each_difference_once() -> None:
    none = AnnouncedNodes(fence=1)
    lost, made = missed(none, _j(lost=("a",), ready=("b",)), 10.0, 60.0)
    assert lost == {"a": 10.0} and [(m.node, m.turn, m.at) for m in made] == [("a", NodeTurn.LOST, 10.0)]
    again = AnnouncedNodes(fence=1, lost=lost)
    assert missed(again, _j(lost=("a",), ready=("b",)), 11.0, 60.0) == (lost, [])
    lost, made = missed(again, _j(ready=("a", "b")), 12.0, 60.0)
    assert lost == {} and [(m.node, m.turn) for m in made] == [("a", NodeTurn.RECOVERED)]


def test_a_node_never_heard_is_not_recovered_and_a_forgotten_one_goes_quietly() -> None:
    rec = AnnouncedNodes(fence=1, lost={"a": 10.0, "gone": 10.0})
    # "a" is judged ready without reporting (known only from replica records after a restart, or its
    # silence excused after our own reconnect): not news.
    unheard = _j(silent=("a",))
    assert missed(rec, unheard, 20.0, 60.0) == ({"a": 10.0, "gone": 10.0}, [])
    # "gone" left the table: kept for node_forget_s from its node.lost (it may report again), then dropped.
    assert missed(rec, unheard, 71.0, 60.0) == ({"a": 10.0}, [])


def test_lost_and_back_in_the_gap_is_not_replayed() -> None:
    """The design's choice: a round trip no leader saw is not announced (nobody knows when it went or
    came, and the node serves now); the pairs stay balanced."""
    assert missed(AnnouncedNodes(fence=1), _j(ready=("a",)), 10.0, 60.0) == ({}, [])
    lost, made = missed(AnnouncedNodes(fence=1, lost={"a": 1.0}), _j(lost=("a",)), 10.0, 60.0)
    assert lost == {"a": 1.0} and made == []


# ---------------------------------------------------------------- the record, on a real nats-server


async def _store(nc: NATS, prefix: str) -> AnnouncedStore:
    return AnnouncedStore(nc.jetstream(), prefix)


async def test_a_stale_fence_cannot_write_over_its_successor(bus_nc: NATS, prefix: str) -> None:
    old, new = await _store(bus_nc, prefix), await _store(bus_nc, prefix)
    assert [e.kind for e in await old.announce(_j(lost=("a",)), 3, 10.0, 60.0)] == ["node.lost"]
    await old.sent(3)
    # The successor reads what the old leader announced: nothing new to say.
    assert await new.announce(_j(lost=("a",)), 5, 11.0, 60.0) == []
    # The old leader, still holding the record it wrote, loses the compare-and-set...
    assert await old.announce(_j(ready=("a",)), 3, 12.0, 60.0) == []
    # ...and, reading again, finds a higher fence: refused.
    with pytest.raises(Fenced, match="fence 5, ours is 3"):
        await old.announce(_j(ready=("a",)), 3, 13.0, 60.0)
    # A fresh writer under the old fence is refused at once.
    with pytest.raises(Fenced):
        await (await _store(bus_nc, prefix)).announce(_j(ready=("a",)), 4, 14.0, 60.0)
    rec, _ = await new.read()
    assert rec is not None and rec.fence == 5 and rec.lost == {"a": 10.0}


async def test_what_a_leader_recorded_but_did_not_publish_is_published_by_the_next(
    bus_nc: NATS, prefix: str
) -> None:
    first = await _store(bus_nc, prefix)
    (ev,) = await first.announce(_j(lost=("a",)), 1, 10.0, 60.0)
    # It stops before publishing (no sent): the next leader republishes it under the same id.
    nxt = await _store(bus_nc, prefix)
    (again,) = await nxt.announce(_j(lost=("a",)), 2, 20.0, 60.0)
    assert again.id == ev.id and again.time == 10.0
    await nxt.sent(2)
    rec, _ = await nxt.read()
    assert rec is not None and rec.unsent == () and rec.fence == 2
    # And once sent, a third leader has nothing to republish.
    assert await (await _store(bus_nc, prefix)).announce(_j(lost=("a",)), 3, 30.0, 60.0) == []


async def test_a_write_of_ours_that_landed_unseen_is_published_on_the_next_read(
    bus_nc: NATS, prefix: str
) -> None:
    """Partition case 4: right after the heal a write timed out but was stored; the next write lost its
    compare-and-set, the record was read again, and its node.recovered, recorded there, was never
    published (the pass found nothing new to say)."""
    ours = await _store(bus_nc, prefix)
    await ours.announce(_j(lost=("a",)), 1, 10.0, 60.0)
    await ours.sent(1)
    # The same tenure's write whose answer never came: another handle on the same fence stands in.
    unseen = await _store(bus_nc, prefix)
    (recovered,) = await unseen.announce(_j(ready=("a",)), 1, 20.0, 60.0)
    assert await ours.announce(_j(ready=("a",)), 1, 21.0, 60.0) == []  # compare-and-set lost
    assert [e.id for e in await ours.announce(_j(ready=("a",)), 1, 22.0, 60.0)] == [recovered.id]
    await ours.sent(1)
    assert await ours.announce(_j(ready=("a",)), 1, 23.0, 60.0) == []


# ---------------------------------------------------------------- two control planes, the lease handed over


@pytest.fixture
async def pair(
    nats_server: NatsServer, prefix: str
) -> AsyncIterator[tuple[ControlPlane, ControlPlane, Clock]]:
    clock = Clock(time.time())
    s = cp_settings(nats_server.url, prefix, lease_ttl_s=60.0, node_lost_s=LOST_S)
    cps = []
    for name in ("cp-a", "cp-b"):
        nc = await bus.connect(s, name, wait=False)
        cp = ControlPlane(s, nc, holder=name, clock=clock)
        await cp.start()
        cps.append(cp)
    try:
        yield cps[0], cps[1], clock
    finally:
        for cp in cps:
            await cp.leadership.release()
            await cp.close()
            await cp.nc.close()


async def _lead(cp: ControlPlane, clock: Clock) -> None:
    assert await cp.lease.step()
    await cp._become_leader()
    await cp._tick(clock())


async def _hand_over(a: ControlPlane) -> None:
    """The leader is cut off: it stops acting and its lease goes (as the TTL would take it)."""
    await a._step_down()
    await a.lease.release()


async def _node_events(nc: NATS, prefix: str) -> list[tuple[str, str]]:
    subj = Subjects(prefix)
    js = nc.jetstream()
    info = await js.stream_info(subj.events_stream)
    out: list[tuple[str, str]] = []
    if info.state.messages == 0:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        ev = decode((await js.get_msg(subj.events_stream, seq)).data or b"", Event)
        if ev.kind.startswith("node."):
            out.append((ev.kind, ev.subject))
    return out


def _heard(cp: ControlPlane, node: str) -> bool:
    rec = cp.state.nodes.get(node)
    return rec is not None and rec.heard


async def test_a_node_lost_in_the_gap_is_announced_once_by_the_next_leader(
    pair: tuple[ControlPlane, ControlPlane, Clock], bus_nc: NATS, prefix: str
) -> None:
    a, b, clock = pair
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    await agent.beat()
    await eventually(lambda: _heard(a, "gpu-0") and _heard(b, "gpu-0"), what="both heard gpu-0")
    await _lead(a, clock)
    await _hand_over(a)
    # gpu-0 goes silent while no one leads: the standby judges it lost, and may say nothing.
    clock.t += LOST_S + 1
    await b._tick(clock())
    assert b.state.nodes["gpu-0"].health is NodeState.LOST
    assert await _node_events(bus_nc, prefix) == []
    await _lead(b, clock)
    for _ in range(3):
        await b._tick(clock())
    assert await _node_events(bus_nc, prefix) == [("node.lost", "gpu-0")]
    rec, _ = await bus.kv_get(
        await bus_nc.jetstream().key_value(Subjects(prefix).bucket_announced),
        ANNOUNCED_NODES_KEY,
        AnnouncedNodes,
    )
    # b's fence: of its takeover or a later renewal (stamped when a write carries a change, not on each).
    assert rec is not None and a.lease.fence < rec.fence <= b.lease.fence
    assert set(rec.lost) == {"gpu-0"} and rec.unsent == ()


@pytest.mark.slow
async def test_a_node_back_in_the_gap_is_announced_recovered_by_the_next_leader(
    pair: tuple[ControlPlane, ControlPlane, Clock], bus_nc: NATS, prefix: str
) -> None:
    """Case 2' in-process: lost (the leader says so), the leader cut off, the node back before the
    standby leads: the standby, leading, says node.recovered."""
    a, b, clock = pair
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    await agent.beat()
    await eventually(lambda: _heard(a, "gpu-0") and _heard(b, "gpu-0"), what="both heard gpu-0")
    await _lead(a, clock)
    clock.t += LOST_S + 1
    await a._tick(clock())
    assert await _node_events(bus_nc, prefix) == [("node.lost", "gpu-0")]
    await _hand_over(a)
    await agent.beat()
    await eventually(lambda: b.state.nodes["gpu-0"].last_seen >= clock.t, what="b heard gpu-0 again")
    await b._tick(clock())
    assert b.state.nodes["gpu-0"].health is NodeState.READY
    await _lead(b, clock)
    await b._tick(clock())
    assert await _node_events(bus_nc, prefix) == [("node.lost", "gpu-0"), ("node.recovered", "gpu-0")]


async def test_a_round_trip_in_the_gap_is_not_announced(
    pair: tuple[ControlPlane, ControlPlane, Clock], bus_nc: NATS, prefix: str
) -> None:
    a, b, clock = pair
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    await agent.beat()
    await eventually(lambda: _heard(a, "gpu-0") and _heard(b, "gpu-0"), what="both heard gpu-0")
    await _lead(a, clock)
    await _hand_over(a)
    clock.t += LOST_S + 1
    await b._tick(clock())  # lost, judged by the standby
    await agent.beat()
    await eventually(lambda: b.state.nodes["gpu-0"].last_seen >= clock.t, what="b heard gpu-0 again")
    await b._tick(clock())  # back, before b leads
    await _lead(b, clock)
    await b._tick(clock())
    assert await _node_events(bus_nc, prefix) == []


async def test_a_silence_excused_after_our_own_reconnect_is_not_a_recovery(
    pair: tuple[ControlPlane, ControlPlane, Clock], bus_nc: NATS, prefix: str
) -> None:
    """Back on the bus, the leader restarts every node's silence clock (none of it was the nodes'): a
    node announced lost is then judged ready for node_lost_s without a word from it. Taken for a
    recovery, it made a node.recovered and, node_lost_s later, a second node.lost."""
    a, _b, clock = pair
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    await agent.beat()
    await eventually(lambda: _heard(a, "gpu-0"), what="a heard gpu-0")
    await _lead(a, clock)
    clock.t += LOST_S + 1
    await a._tick(clock())
    assert await _node_events(bus_nc, prefix) == [("node.lost", "gpu-0")]
    a.bus_lost()
    a.bus_back()
    await a._tick(clock())
    assert a.state.nodes["gpu-0"].health is NodeState.READY
    clock.t += LOST_S / 2
    await a._tick(clock())
    clock.t += LOST_S
    await a._tick(clock())
    assert await _node_events(bus_nc, prefix) == [("node.lost", "gpu-0")]
