"""Pure parts: capacity bar segments, "-" for unknown, state tones, the usage book."""

from __future__ import annotations

import pytest

from llmgw_common.router_messages import UsageReport
from llmgw_controlplane.console import format as fmt
from llmgw_controlplane.console.usage import UsageBook, UsageRow


def test_bar_unhealthy_is_neither_used_nor_free() -> None:
    segs = fmt.bar(used=4, free=3, unhealthy=1, total=8)
    assert [(s.kind, s.count, s.start, s.percent) for s in segs] == [
        ("used", 4, 0.0, 50.0),
        ("free", 3, 50.0, 37.5),
        ("unhealthy", 1, 87.5, 12.5),
    ]


def test_bar_healthy_unplaceable_is_held_not_free() -> None:
    segs = fmt.bar(used=20, free=3, unhealthy=1, total=32)
    assert [(s.kind, s.count) for s in segs] == [("used", 20), ("free", 3), ("unhealthy", 1), ("held", 8)]
    assert sum(s.percent for s in segs) == pytest.approx(100.0)
    assert segs[-1].start + segs[-1].percent == pytest.approx(100.0)


def test_bar_empty_and_inconsistent() -> None:
    assert fmt.bar(0, 0, 0, 0) == ()
    assert [s.kind for s in fmt.bar(0, 0, 0, 4)] == ["held"]
    # More counted than total never makes a negative segment.
    assert [s.kind for s in fmt.bar(3, 2, 0, 4)] == ["used", "free"]


def test_dash_none_is_not_zero() -> None:
    assert fmt.dash(None) == "-"
    assert fmt.dash(None, " GB") == "-"
    assert fmt.dash(0) == "0"
    assert fmt.dash(0.0, " GB") == "0 GB"
    assert fmt.dash(512.0, " GB") == "512 GB"


def test_durations_and_times() -> None:
    assert fmt.duration(None) == "-"
    assert fmt.duration(-1.0) == "-"  # the JSON form of "unknown"
    assert fmt.duration(0) == "0s"
    assert fmt.duration(7300) == "2h1m"
    assert fmt.ago(None, 100.0) == "-"
    assert fmt.ago(40.0, 100.0) == "1m ago"
    assert fmt.until(160.0, 100.0) == "in 1m"
    assert fmt.until(90.0, 100.0) == "due"
    assert fmt.until(None, 100.0) == "-"
    assert fmt.utc(0) == "1970-01-01 00:00:00Z"
    assert fmt.utc(None) == "-"
    assert fmt.thousands(1234567) == "1\u2009234\u2009567"
    assert fmt.counts({"b": 2, "a": 1}) == "a 1, b 2"
    assert fmt.counts({}) == "none"


@pytest.mark.parametrize(
    ("state", "tone"),
    [
        ("ready", "good"),
        ("ok", "good"),
        ("unreachable", "warn"),
        ("lost", "bad"),
        ("failed", "bad"),
        (None, "dim"),
        ("new", "dim"),
    ],
)
def test_tone(state: str | None, tone: str) -> None:
    assert fmt.tone(state) == tone


def test_attention_worst_first_with_first_reason() -> None:
    from llmgw_common.ctl import NodeInfo

    nodes = [
        NodeInfo(name="a", state="ready", cordoned=True, gpus_unhealthy=2),
        NodeInfo(name="b", state="ready"),
        NodeInfo(name="c", state="unreachable"),
        NodeInfo(name="d", state="lost", draining=True),
        NodeInfo(name="e", state="ready", draining=True, cordoned=True),
        NodeInfo(name="f", state="ready", cordoned=True),
        NodeInfo(name="g", state="ready", gpus_unhealthy=1),
    ]
    assert [(n.name, why, t) for n, why, t in fmt.attention(nodes)] == [
        ("d", "lost", "bad"),
        ("c", "unreachable", "warn"),
        ("a", "2 unhealthy GPUs", "bad"),
        ("g", "1 unhealthy GPU", "bad"),
        ("e", "draining", "warn"),
        ("f", "cordoned", "warn"),
    ]
    assert fmt.attention([NodeInfo(name="b", state="ready")]) == []


def _rep(
    router: str, sent_at: float, usage: dict[str, dict[str, tuple[int, int, int]]], since: float = 0.0
) -> UsageReport:
    return UsageReport(router=router, since=since, sent_at=sent_at, usage=usage)


def test_usage_book_sums_routers_keeps_newest_per_router() -> None:
    book = UsageBook()
    assert book.view().rows == () and book.view().routers == 0 and book.view().since is None
    book.add(_rep("r1", 10, {"k1": {"m": (1, 10, 5)}}, since=5), now=11)
    book.add(_rep("r1", 20, {"k1": {"m": (3, 30, 15)}}, since=5), now=21)  # cumulative: replaces
    book.add(_rep("r1", 15, {"k1": {"m": (2, 20, 10)}}, since=5), now=22)  # late, older: ignored
    book.add(_rep("r2", 18, {"k1": {"m": (1, 100, 100)}, "k2": {"m": (7, 1, 1)}}, since=3), now=19)
    v = book.view()
    assert v.routers == 2 and v.since == 3 and v.updated_at == 21
    assert v.rows == (UsageRow("k1", "m", 4, 130, 115), UsageRow("k2", "m", 7, 1, 1))
    assert v.rows[0].total_tokens == 245


def test_usage_book_forgets_the_longest_silent_router_past_its_cap() -> None:
    book = UsageBook(max_routers=2)
    book.add(_rep("old", 1, {"k": {"m": (1, 1, 1)}}), now=1)
    book.add(_rep("mid", 2, {"k": {"m": (1, 1, 1)}}), now=2)
    book.add(_rep("new", 3, {"k": {"m": (1, 1, 1)}}), now=3)
    v = book.view()
    assert v.routers == 2 and v.rows[0].requests == 2


def test_usage_book_drops_forged_future_reports_and_keeps_counting(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    book = UsageBook()
    book.add(_rep("r1", 10, {"k": {"m": (1, 10, 5)}}), now=11)
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        book.add(_rep("r1", 1e300, {"k": {"m": (0, 0, 0)}}), now=12)
        book.add(_rep("r1", float("nan"), {"k": {"m": (0, 0, 0)}}), now=12)
        book.add(_rep("r1", 12, {"k": {"m": (0, 0, 0)}}, since=float("inf")), now=12)
    assert book.view().rows == (UsageRow("k", "m", 1, 10, 5),)
    assert sum("not believed from router r1" in r.getMessage() for r in caplog.records) == 1
    # Genuine later reports still count (one forged 1e300 used to freeze this router's row forever).
    book.add(_rep("r1", 13, {"k": {"m": (2, 20, 10)}}), now=13)
    assert book.view().rows == (UsageRow("k", "m", 2, 20, 10),)
    # A report a little ahead (within the skew) is kept, but outranks the next genuine one only until
    # that one was sent after it arrived.
    book.add(_rep("r1", 50, {"k": {"m": (3, 30, 15)}}), now=14)
    book.add(_rep("r1", 15, {"k": {"m": (4, 40, 20)}}), now=15)
    assert book.view().rows == (UsageRow("k", "m", 4, 40, 20),)


def _wide(router: str, sent_at: float, entries: int) -> UsageReport:
    return _rep(router, sent_at, {f"k{i}": {"m": (1, 1, 1)} for i in range(entries)})


def test_usage_book_refuses_a_report_with_too_many_entries_and_says_so_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from llmgw_runtime.clockcheck import Doubts

    doubts = Doubts(logging.getLogger("llmgw.controlplane"), every_s=60.0)
    book = UsageBook(max_report_entries=3, doubts=doubts)
    book.add(_wide("r1", 10, 3), now=10)  # at the cap: kept
    with caplog.at_level(logging.WARNING, logger="llmgw.controlplane"):
        book.add(_wide("r1", 11, 4), now=11)
        book.add(_wide("r1", 40, 4), now=40)
        lines = [r.getMessage() for r in caplog.records if "not believed from router r1" in r.getMessage()]
        assert len(lines) == 1 and "4 key/model entries" in lines[0], lines
        book.add(_wide("r1", 72, 4), now=72)  # a minute after the first line: said again
        lines = [r.getMessage() for r in caplog.records if "not believed from router r1" in r.getMessage()]
        assert len(lines) == 2
    assert doubts.count == 3
    v = book.view()
    assert v.routers == 1 and v.updated_at == 10 and len(v.rows) == 3  # the kept report stands


def test_usage_book_forgets_the_longest_silent_routers_past_its_entry_cap() -> None:
    book = UsageBook(max_entries=4)
    book.add(_wide("old", 1, 2), now=1)
    book.add(_wide("mid", 2, 2), now=2)
    assert book.view().routers == 2
    book.add(_wide("new", 3, 1), now=3)  # 5 entries kept would be over the cap: "old" goes
    v = book.view()
    assert v.routers == 2 and v.since == 0 and v.rows[0] == UsageRow("k0", "m", 2, 2, 2)
    book.add(_wide("mid", 4, 3), now=4)  # a router's own bigger report replaces its old one: 4, fits
    assert book.view().routers == 2
    book.add(_wide("new", 5, 2), now=5)  # 5 again: "mid" is now the longest silent, it goes
    v = book.view()
    assert v.routers == 1 and len(v.rows) == 2
