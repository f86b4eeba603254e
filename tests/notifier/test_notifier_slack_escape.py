"""Slack text carries names and summaries as text, never as Slack markup (issue 11).

Slack's rule for message text: ``&``, ``<`` and ``>`` are control characters, sent as ``&amp;``,
``&lt;`` and ``&gt;``; ``<https://x|label>`` is a link and ``<!channel>`` pings everyone.
"""

from __future__ import annotations

import json

from llmgw_common.messages import Event, Webhook
from llmgw_notifier.formats import render, slack_text

HOSTILE = "<https://evil.example|click here> <!channel> <@U123> a&b"
SAFE = "&lt;https://evil.example|click here&gt; &lt;!channel&gt; &lt;@U123&gt; a&amp;b"


def ev(subject: str, summary: str = "", i: int = 1, **details: object) -> Event:
    return Event(
        id=f"e{i}", kind="model.down", subject=subject, time=1000.0 + i, summary=summary, details=details
    )


def _no_markup(text: str) -> None:
    assert "<" not in text and ">" not in text, text
    assert "&" not in text.replace("&amp;", "").replace("&lt;", "").replace("&gt;", ""), text


def test_one_event_subject_and_summary_are_escaped() -> None:
    text = slack_text([ev(HOSTILE, f"model {HOSTILE} has no ready replica")])
    _no_markup(text)
    assert f"`{SAFE}`" in text and f"model {SAFE} has no ready replica" in text


def test_default_summary_and_groups_are_escaped() -> None:
    _no_markup(slack_text([ev(HOSTILE)]))
    text = slack_text([ev(f"{HOSTILE}{i}", HOSTILE, i) for i in range(30)])
    _no_markup(text)
    assert text.count(SAFE) >= 30


def test_control_characters_are_shown_not_sent() -> None:
    text = slack_text([ev("n1", "engine said \x1b[2Jboom\x07")])
    assert "\x1b" not in text and "\x07" not in text
    assert "engine said \\x1b[2Jboom\\x07" in text


def test_the_slack_body_on_the_wire_is_escaped_and_json_is_untouched() -> None:
    events = [ev(HOSTILE, HOSTILE)]
    slack = json.loads(render(events, Webhook(url="http://r/x", format="slack")).body)
    _no_markup(slack["text"])
    # The generic JSON format is data for a program: the receiver escapes for its own medium.
    plain = json.loads(render(events, Webhook(url="http://r/x", format="json")).body)
    assert plain["subject"] == HOSTILE and plain["summary"] == HOSTILE
