from __future__ import annotations

import pytest

from llmgw_common.durations import format_duration, parse_duration
from llmgw_common.subjects import Subjects, check_token


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("30s", 30),
        ("10m", 600),
        ("1h30m", 5400),
        ("30d", 2592000),
        ("250ms", 0.25),
        (" 2h ", 7200),
        ("45", 45),
        (12, 12),
        (1.5, 1.5),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "soon", "10x", "-5", "5m soon", -1, True])
def test_parse_duration_refuses(bad: str | int) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize(
    "seconds, text", [(0, "0s"), (59, "59s"), (61, "1m1s"), (3600, "1h"), (90000, "1d1h")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_subjects_use_the_prefix_everywhere() -> None:
    s = Subjects("blue")
    assert s.heartbeat("n1") == "blue.node.n1.heartbeat"
    assert s.all_nodes("load") == "blue.node.*.load"
    assert s.idle("r1") == "blue.router.r1.idle"
    assert s.ctl("nodes") == "blue.ctl.nodes"
    assert s.event("node.lost") == "blue.events.node.lost"
    assert s.events_stream == "BLUE_EVENTS"
    assert {s.bucket_assign, s.bucket_routing, s.bucket_keys} == {"blue_assign", "blue_routing", "blue_keys"}


@pytest.mark.parametrize("bad", ["a.b", "a b", "a*", ">", ""])
def test_tokens_refuse_subject_syntax(bad: str) -> None:
    with pytest.raises(ValueError):
        check_token(bad)
