"""What a receiver gets: a Slack incoming-webhook payload or generic JSON, optionally signed.

Generic JSON for one event::

    {"id": ..., "kind": "node.lost", "subject": "gpu-a3", "time": "2026-11-29T12:03:05Z",
     "timestamp": 1795867385.0, "summary": ..., "details": {...}}

For a group (a storm of one kind), the same keys describe the group (``id`` is ``group-<hash of the
member ids>``, ``subject`` the first member's) plus ``"grouped": true``, ``"subjects": [...]`` and
``"events": [<one object per event, as above>]``. Receivers drop duplicates by ``id`` (and, for
groups, by the member ids: after a notifier restart a storm may be grouped differently).

With a secret, ``X-Llmgw-Signature: sha256=<hex>`` is the HMAC-SHA256 of the raw body under it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llmgw_common.messages import Event, Webhook
from llmgw_common.names import visible

SIGNATURE_HEADER = "X-Llmgw-Signature"
EVENT_ID_HEADER = "X-Llmgw-Event-Id"
EVENT_KIND_HEADER = "X-Llmgw-Event-Kind"
FORMATS = ("json", "slack")
# Lines listed in one Slack message before "... and N more".
SLACK_MAX_LINES = 25

# kind -> (one, many, marker, what to do)
_KINDS: dict[str, tuple[str, str, str, str]] = {
    "node.lost": (
        "node lost",
        "nodes lost",
        ":red_circle:",
        "Check the node (power, network, agent); its replicas are rebuilt elsewhere where they fit. "
        "`llmgw ctl nodes`",
    ),
    "node.recovered": ("node back", "nodes back", ":large_green_circle:", "Nothing to do. `llmgw ctl nodes`"),
    "model.down": (
        "model down",
        "models down",
        ":red_circle:",
        "Requests to it fail or time out. `llmgw ctl replicas` shows its replicas and their errors",
    ),
    "model.recovered": (
        "model back",
        "models back",
        ":large_green_circle:",
        "Nothing to do. `llmgw ctl models`",
    ),
    "placement.failing": (
        "model cannot be placed",
        "models cannot be placed",
        ":warning:",
        "No node can hold it now. `llmgw ctl explain-placement MODEL` says what is short",
    ),
    # Scaling (issue 13): informational; a receiver that does not want them filters them out.
    "model.scaled_to_zero": (
        "model scaled to zero",
        "models scaled to zero",
        ":zzz:",
        "Nothing to do: it was unused for its idle_after; a request wakes it. `llmgw ctl status`",
    ),
    "model.woken": (
        "model woken",
        "models woken",
        ":sunrise:",
        "Nothing to do; the cold start is in the details. `llmgw ctl status`",
    ),
    # Following the load (issue 21): informational, like the scaling kinds above.
    "model.scaled_up": (
        "model scaled up",
        "models scaled up",
        ":chart_with_upwards_trend:",
        "Nothing to do: its load exceeded its target; the reason is in the details. `llmgw ctl status`",
    ),
    "model.scaled_down": (
        "model scaled down",
        "models scaled down",
        ":chart_with_downwards_trend:",
        "Nothing to do: its load stayed below its target; one replica drains. `llmgw ctl status`",
    ),
    "model.evicted": (
        "replica evicted",
        "replicas evicted",
        ":arrows_counterclockwise:",
        "Its idle replica made room for another model; too many means too few cards for the models in use. "
        "`llmgw ctl explain-placement MODEL`",
    ),
}


@dataclass(frozen=True, slots=True)
class Rendered:
    id: str
    body: bytes
    headers: dict[str, str]


def group_id(events: Sequence[Event]) -> str:
    """The id a receiver dedupes on: the event's own, or a stable hash of a group's member ids."""
    if len(events) == 1:
        return events[0].id
    h = hashlib.sha256("\n".join(e.id for e in events).encode()).hexdigest()[:24]
    return f"group-{h}"


def sign(body: bytes, secret: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(body: bytes, secret: str, header: str | None) -> bool:
    """A receiver's check of ``X-Llmgw-Signature`` (constant-time)."""
    return header is not None and hmac.compare_digest(sign(body, secret), header)


def utc(ts: float, *, seconds: bool = True) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S UTC" if seconds else "%H:%M UTC")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _event_json(e: Event) -> dict[str, Any]:
    return {
        "id": e.id,
        "kind": e.kind,
        "subject": e.subject,
        "time": iso(e.time),
        "timestamp": e.time,
        "summary": e.summary or default_summary(e),
        "details": e.details,
    }


def json_payload(events: Sequence[Event]) -> dict[str, Any]:
    if len(events) == 1:
        return _event_json(events[0])
    first = events[0]
    return {
        "id": group_id(events),
        "kind": first.kind,
        "subject": first.subject,
        "time": iso(first.time),
        "timestamp": first.time,
        "summary": _group_title(events),
        "details": {"count": len(events)},
        "grouped": True,
        "subjects": [e.subject for e in events],
        "events": [_event_json(e) for e in events],
    }


def default_summary(e: Event) -> str:
    one, _, _, _ = _KINDS.get(e.kind, (e.kind, e.kind, "", ""))
    return f"{one}: {e.subject}"


def _group_title(events: Sequence[Event]) -> str:
    kind = events[0].kind
    _, many, _, _ = _KINDS.get(kind, (kind, kind, "", ""))
    start, end = min(e.time for e in events), max(e.time for e in events)
    when = utc(start) if end - start < 1 else f"between {utc(start)} and {utc(end)}"
    return f"{len(events)} {many} {when}"


def slack_escape(text: str) -> str:
    """Text as Slack shows it, never as Slack markup: ``&``, ``<``, ``>`` escaped (Slack's rule), so a
    name like ``<https://evil|click>`` or ``<!channel>`` is neither a link nor a ping; control
    characters written out (``\\x1b``)."""
    return visible(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"), keep="\n")


def slack_text(events: Sequence[Event]) -> str:
    """A readable message: what, where, since when, what to do. Every name and summary is escaped."""
    kind = events[0].kind
    one, _, marker, todo = _KINDS.get(kind, (kind, kind, ":information_source:", ""))
    esc = slack_escape
    lines: list[str] = []
    if len(events) == 1:
        e = events[0]
        lines.append(f"{marker} *{esc(one)}* `{esc(e.subject)}` since {utc(e.time)}")
        lines.append(esc(e.summary or default_summary(e)))
    else:
        lines.append(
            f"{marker} *{esc(_group_title(events))}*: "
            + ", ".join(f"`{esc(e.subject)}`" for e in events[:50])
        )
        shown = events[:SLACK_MAX_LINES]
        lines.extend(
            f"• {utc(e.time)} `{esc(e.subject)}`: {esc(e.summary or default_summary(e))}" for e in shown
        )
        if len(events) > len(shown):
            lines.append(f"… and {len(events) - len(shown)} more")
    if todo:
        lines.append(f"What to do: {todo}")
    return "\n".join(lines)


def header_text(text: str) -> str:
    """``text`` fit for an HTTP header: printable ASCII, the rest written out (``\\xe9``, ``\\r``).

    Ids and kinds come from the bus: one the HTTP client refused (not ASCII) made the delivery worker
    die on it again after every restart, and no later event reached that webhook. The body keeps the
    text as it is.
    """
    return visible(text).encode("ascii", "backslashreplace").decode("ascii")


def render(events: Sequence[Event], hook: Webhook) -> Rendered:
    """The request body and headers for ``hook``; ``events`` share one kind (a group or one event)."""
    if not events:
        raise ValueError("nothing to render")
    rid = group_id(events)
    payload: dict[str, Any]
    if hook.format == "slack":
        payload = {"text": slack_text(events)}
    else:
        payload = json_payload(events)
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str).encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "llmgw-notifier",
        EVENT_ID_HEADER: header_text(rid),
        EVENT_KIND_HEADER: header_text(events[0].kind),
    }
    if hook.secret:
        headers[SIGNATURE_HEADER] = sign(body, hook.secret)
    return Rendered(rid, body, headers)
