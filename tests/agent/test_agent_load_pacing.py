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
        # An adapter set change skips the gap (held requests wait for it); busy adapters do not.
        (Sent(line(), 0.0), 0.0, line(adapters=("a1",)), True),
        (Sent(line(adapters=("a1",)), 0.0), 0.125, line(), True),
        (Sent(line(), 0.0), 0.125, line(adapter_errors={"a1": "missing weights"}), True),
        (Sent(line(adapters=("a1", "a2")), 0.0), 0.125, line(adapters=("a2", "a1"), running=1.0), False),
        (Sent(line(adapters=("a1",)), 0.0), 0.125, line(adapters=("a1",), adapters_busy=("a1",)), False),
    ],
    ids=[
        "first",
        "same",
        "heartbeat",
        "too-soon",
        "changed",
        "blanked",
        "kv",
        "adapters",
        "adapter-loaded-at-once",
        "adapter-unloaded-at-once",
        "adapter-error-at-once",
        "adapters-reordered-too-soon",
        "busy-too-soon",
    ],
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


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([(), ("a1",), ("a1", "a2")])), max_size=120)
)
def test_only_an_adapter_set_change_goes_out_within_the_gap(
    steps: list[tuple[int, tuple[str, ...]]],
) -> None:
    """Readings every 125 ms changing running and the adapters loaded: a line within 250 ms of the last
    one goes out exactly when its adapter set differs from the last line's, and none is ever withheld
    that changed its adapters, so the set reported is always the newest one read."""
    p = LoadPacer(P)
    last: tuple[float, ReplicaLoad] | None = None
    for i, (value, adapters) in enumerate(steps):
        now = i * TICK
        reading = line(running=float(value), adapters=adapters)
        out = p.take([reading], now, [("r", 0)])
        if last is not None and now - last[0] < P.min_gap_s:
            assert bool(out) is (set(adapters) != set(last[1].adapters)), (i, last)
        if last is not None and set(adapters) != set(last[1].adapters):
            assert out == (reading,)
        if out:
            last = (now, reading)


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


class Adapters(Engines):
    """Engines whose readings carry the adapters loaded, read when the reading starts (as the agent's)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, tuple[str, ...]] = {}

    async def scrape(self, sh: FakeShard) -> ReplicaLoad:
        held = self.loaded.get(sh.rid, ())
        got = await super().scrape(sh)
        return got.model_copy(update={"adapters": held})


async def test_a_replica_asked_for_is_read_and_sent_at_once_and_a_reading_from_before_is_dropped() -> None:
    e = Adapters()
    shards = [FakeShard("a"), FakeShard("b")]
    feed = LoadFeed(lambda: shards, e.scrape, e.send, P, scrape_s=0.02)
    try:
        assert len(await feed.tick(0.0)) == 2
        # An adapter loaded on a, 50 ms after its last line and off the grid: read and sent at once,
        # only a is read.
        e.loaded["a"] = ("fr",)
        feed.read_now(("a", 0))
        got = await feed.tick_asked(0.05)
        assert got == (line("a", adapters=("fr",)),)
        # Its load changed meanwhile, too soon for the gap: not sent until an adapter changes again.
        e.values["a"] = 3.0
        assert await feed.tick(0.125) == ()
        # A reading under way when the next change came began before it: dropped, never sent.
        e.slow = {"a"}
        assert await feed.tick(0.25) == ()  # a's reading waits (b unchanged)
        e.loaded["a"] = ()
        feed.read_now(("a", 0))
        e.slow = set()
        e.release.set()
        got = await feed.tick_asked(0.3)
        assert got == (line("a", running=3.0),)
        assert e.most_at_once == 1  # the dropped reading was cancelled before the new one began
        # Nothing asked: an asked round reads nothing.
        assert await feed.tick_asked(0.31) == ()
        assert [x.replica_id for batch in e.sent for x in batch] == ["a", "b", "a", "a"]
    finally:
        await feed.aclose()


async def test_the_running_feed_reads_a_replica_asked_for_between_its_ticks() -> None:
    """The loop itself: ticks 10 s apart, a replica asked for is sent within a fraction of that."""
    e = Adapters()
    shards = [FakeShard("a")]
    feed = LoadFeed(lambda: shards, e.scrape, e.send, P, scrape_s=10.0)
    loop = asyncio.get_running_loop()
    run = asyncio.create_task(feed.run())
    try:
        await asyncio.wait_for(_sent(e, 1), 5)
        e.loaded["a"] = ("fr",)
        t0 = loop.time()
        feed.read_now(("a", 0))
        await asyncio.wait_for(_sent(e, 2), 5)
        assert loop.time() - t0 < 2.0
        assert e.sent[-1] == (line("a", adapters=("fr",)),)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


async def _sent(e: Engines, n: int) -> None:
    while len(e.sent) < n:
        await asyncio.sleep(0.01)
