"""`ctl status` and `ctl explain-placement` show scaling (issue 13): cold models, wakes in progress,
cold-start times, recent evictions, and what would be evicted."""

from __future__ import annotations

from llmgw_cli.ctl_render import render_explain
from llmgw_cli.ctl_status import render_status
from llmgw_common.ctl import EvictionInfo, ExplainReply, StatusReply


def test_status_shows_cold_waking_cold_starts_and_evictions() -> None:
    s = StatusReply(
        cold=("a", "c"),
        waking={"b": "1 replica starting on n1"},
        cold_starts={"b": 12.5},
        evictions=(
            EvictionInfo(
                at=0.0, replica_id="a-1", model="a", for_model="b", nodes=("n1",), reason="idle for 5m"
            ),
        ),
    )
    text = render_status(s)
    assert "cold (scaled to zero): a, c" in text
    assert "waking: b (1 replica starting on n1)" in text
    assert "last cold start: b 12.5s" in text
    assert "evicted: a-1 of a on n1 for b (idle for 5m)" in text


def test_status_without_scaling_says_nothing_of_it() -> None:
    text = render_status(StatusReply())
    assert "cold" not in text and "evicted" not in text


def test_explain_says_what_would_be_evicted() -> None:
    e = ExplainReply(
        model="b", placeable=False, summary="needs 1 H100", eviction="would evict a-1 of a on n1"
    )
    assert "eviction: would evict a-1 of a on n1" in render_explain(e)
