"""When the agent sends a replica's load (issue 34): on change, at most every 250 ms, at least every
heartbeat; and the feed that reads the engines, on ticks given as numbers (no clock, no sleeping)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_agent.load_feed import LoadFeed
from llmgw_agent.load_pacing import LoadPacer, Pacing, Sent, due
from llmgw_common.messages import ReplicaLoad

P = Pacing(min_gap_s=0.25, max_gap_s=2.0)
TICK = 0.125


def line(rid: str = "r", running: float | None = 0.0, **kw: object) -> ReplicaLoad:
    return ReplicaLoad(replica_id=rid, running=running, waiting=0.0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("last", "now", "reading", "want"),
    [
        (None, 0.0, line(), True),  # never sent: at once
        (Sent(line(), 0.0), 1.9, line(), False),  # unchanged, before the heartbeat
        (Sent(line(), 0.0), 2.0, line(), True),  # unchanged, a heartbeat later
        (Sent(line(), 0.0), 0.125, line(running=1.0), False),  # changed, too soon
        (Sent(line(), 0.0), 0.25, line(running=1.0), True),  # changed, 250 ms on
        (Sent(line(), 0.0), 0.25, line(running=None), True),  # blanked (engine unreachable) is a change
        (Sent(line(), 0.0), 0.5, line(kv_use=0.25), True),  # any field counts
        (Sent(line(), 0.0), 0.5, line(adapters=("a1",)), True),
    ],
    ids=["first", "same", "heartbeat", "too-soon", "changed", "blanked", "kv", "adapters"],
)
def test_due(last: Sent | None, now: float, reading: ReplicaLoad, want: bool) -> None:
    assert due(reading, last, now, P) is want


def test_the_latest_reading_goes_out_when_the_gap_allows() -> None:
    p = LoadPacer(P)
    keys = [("r", 0)]
    assert p.take([line(running=0.0)], 0.0, keys) == (line(running=0.0),)
    assert p.take([line(running=1.0)], 0.125, keys) == ()
    # Changed again before the gap ended: the newest reading is the one sent.
    assert p.take([line(running=2.0)], 0.25, keys) == (line(running=2.0),)
    assert p.take([line(running=2.0)], 0.375, keys) == ()


def test_a_replica_gone_is_forgotten_and_sent_at_once_when_back() -> None:
    p = LoadPacer(P)
    assert p.take([line("a"), line("b")], 0.0, [("a", 0), ("b", 0)]) == (line("a"), line("b"))
    # b no longer runs: a reading of it arriving late is not sent, and its record goes.
    assert p.take([line("b", running=3.0)], 0.125, [("a", 0)]) == ()
    assert p.take([line("b")], 0.25, [("a", 0), ("b", 0)]) == (line("b"),)


@settings(max_examples=200, deadline=None)
@given(
    changes=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    lost=st.sets(st.integers(1, 119), max_size=30),
)
def test_paced_lines_keep_their_bounds(changes: list[int], lost: set[int]) -> None:
    """Ticks every 125 ms, a reading each (``lost``: none that tick, a slow engine). A reading that
    differs from the last line goes out as soon as 250 ms have passed since it, never sooner; an
    unchanged one a heartbeat on; so gaps are never under 250 ms, nor over a heartbeat plus the ticks
    without a reading."""
    p = LoadPacer(P)
    sent: list[tuple[float, int]] = []
    for i, value in enumerate(changes):
        now = i * TICK
        if i in lost:
            continue
        out = p.take([line(running=float(value))], now, [("r", 0)])
        gap = now - sent[-1][0] if sent else None
        changed = bool(sent) and sent[-1][1] != value
        want = gap is None or gap >= P.max_gap_s or (changed and gap >= P.min_gap_s)
        assert bool(out) is want, (i, value, sent[-3:])
        if out:
            assert out == (line(running=float(value)),)
            sent.append((now, value))
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(sent)]
    assert all(g >= P.min_gap_s for g in gaps), gaps
    longest_silence = max((len(g) for g in _runs(lost, len(changes))), default=0) * TICK
    assert all(g <= P.max_gap_s + longest_silence for g in gaps), gaps


def _runs(lost: set[int], n: int) -> list[range]:
    out, start = [], None
    for i in range(n + 1):
        if i in lost and start is None:
            start = i
        elif i not in lost and start is not None:
            out.append(range(start, i))
            start = None
    return out


@dataclass(frozen=True)
class FakeShard:
    rid: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.rid, 0)


class Engines:
    """Scrapes answered from a table; ``slow`` ones wait for ``release``. Counts readings under way."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.slow: set[str] = set()
        self.release = asyncio.Event()
        self.under_way: dict[str, int] = {}
        self.most_at_once = 0
        self.sent: list[tuple[ReplicaLoad, ...]] = []

    async def scrape(self, sh: FakeShard) -> ReplicaLoad:
        self.under_way[sh.rid] = self.under_way.get(sh.rid, 0) + 1
        self.most_at_once = max(self.most_at_once, self.under_way[sh.rid])
        try:
            if sh.rid in self.slow:
                await self.release.wait()
            return line(sh.rid, running=self.values.get(sh.rid, 0.0))
        finally:
            self.under_way[sh.rid] -= 1

    async def send(self, lines: tuple[ReplicaLoad, ...]) -> None:
        self.sent.append(lines)


async def test_a_slow_engine_holds_only_itself_and_is_read_once_at_a_time() -> None:
    e = Engines()
    shards = [FakeShard("fast"), FakeShard("slow")]
    e.slow = {"slow"}
    feed = LoadFeed(lambda: shards, e.scrape, e.send, P, scrape_s=0.02)
    try:
        assert [x.replica_id for x in await feed.tick(0.0)] == ["fast"]
        e.values["fast"] = 2.0
        assert await feed.tick(0.125) == ()  # changed, but 125 ms after its last line
        assert [(x.replica_id, x.running) for x in await feed.tick(0.25)] == [("fast", 2.0)]
        e.values["slow"] = 5.0
        e.release.set()
        # The slow engine's reading, started at the first tick, is taken when done: once at a time.
        got = await feed.tick(0.375)
        assert [(x.replica_id, x.running) for x in got] == [("slow", 5.0)]
        assert e.most_at_once == 1
    finally:
        await feed.aclose()


async def test_a_shard_that_stops_has_its_reading_cancelled_and_no_line() -> None:
    e = Engines()
    shards = [FakeShard("a"), FakeShard("b")]
    e.slow = {"b"}
    feed = LoadFeed(lambda: shards, e.scrape, e.send, P, scrape_s=0.02)
    try:
        await feed.tick(0.0)
        shards.pop()
        e.release.set()
        e.values["b"] = 9.0
        assert await feed.tick(2.0) == (line("a"),)  # a: its heartbeat; b: gone
        assert e.sent == [(line("a"),), (line("a"),)]
    finally:
        await feed.aclose()


async def test_a_failing_reader_is_logged_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    async def scrape(sh: FakeShard) -> ReplicaLoad:
        if sh.rid == "bad":
            raise RuntimeError("boom")
        return line(sh.rid)

    sent: list[tuple[ReplicaLoad, ...]] = []

    async def send(lines: tuple[ReplicaLoad, ...]) -> None:
        sent.append(lines)

    feed = LoadFeed(lambda: [FakeShard("ok"), FakeShard("bad")], scrape, send, P, scrape_s=0.02)
    assert await feed.tick(0.0) == (line("ok"),)
    assert "reading the load of ('bad', 0) failed" in caplog.text
