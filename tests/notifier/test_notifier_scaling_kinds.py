"""The notifier renders the scaling events (issue 13) with a title and what to do, alone or grouped."""

from __future__ import annotations

import pytest

from llmgw_common.messages import Event
from llmgw_notifier.formats import slack_text


@pytest.mark.parametrize(
    "kind, one, many, todo",
    [
        ("model.scaled_to_zero", "model scaled to zero", "models scaled to zero", "a request wakes it"),
        ("model.woken", "model woken", "models woken", "`llmgw ctl status`"),
        ("model.evicted", "replica evicted", "replicas evicted", "`llmgw ctl explain-placement MODEL`"),
    ],
)
def test_scaling_events_have_a_title_and_what_to_do(kind: str, one: str, many: str, todo: str) -> None:
    text = slack_text([Event(id="x", kind=kind, subject="judge", time=43380.0, summary="")])
    assert f"*{one}* `judge`" in text and todo in text
    grouped = slack_text([Event(id=f"x{i}", kind=kind, subject=f"m{i}", time=43380.0 + i) for i in range(3)])
    assert f"*3 {many} between" in grouped
