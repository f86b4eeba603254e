"""Pure helpers the templates call: bar segments, ages, numbers where ``None`` means "not known".

Nothing here counts the fleet: the numbers come from the ctl views (``llmgw_controlplane.views``), so
the console and ``llmgw ctl`` cannot disagree. These only shape them for the page.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw_common.ctl import NodeInfo
from llmgw_common.durations import format_duration


@dataclass(frozen=True, slots=True)
class Segment:
    kind: str  # used, free, unhealthy, held
    count: int
    start: float  # percent of the bar before this segment
    percent: float


def bar(used: int, free: int, unhealthy: int, total: int) -> tuple[Segment, ...]:
    """Segments of a capacity bar, in a fixed order, zero-width ones left out.

    Unhealthy GPUs are their own segment: neither used nor free (ARCHITECTURE #2). What is left of
    ``total`` after the three is healthy but not placeable (its node is cordoned, draining or
    unreachable), shown as ``held`` rather than folded into free.
    """
    if total <= 0:
        return ()
    held = max(0, total - used - free - unhealthy)
    out = []
    start = 0.0
    for kind, n in (("used", used), ("free", free), ("unhealthy", unhealthy), ("held", held)):
        if n > 0:
            width = 100.0 * n / total
            out.append(Segment(kind, n, round(start, 3), round(width, 3)))
            start += width
    return tuple(out)


_TONES = {
    "ok": "good",
    "ready": "good",
    "off": "dim",
    "stopping": "dim",
    "stopped": "dim",
    "degraded": "warn",
    "starting": "warn",
    "unreachable": "warn",
    "waiting": "warn",
    "not heard": "warn",
    "backoff": "bad",
    "down": "bad",
    "failed": "bad",
    "lost": "bad",
    "unplaceable": "bad",
}


def tone(state: str | None) -> str:
    """The CSS class for a node, model, replica or shard state: good, warn, bad, dim."""
    return _TONES.get(state or "", "dim")


def dash(value: object, unit: str = "") -> str:
    """``-`` for a value nobody reported (None), never 0; numbers compactly."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}{unit}"
    return f"{value}{unit}"


def duration(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "-"
    return format_duration(seconds)


def ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    return f"{format_duration(now - ts)} ago"


def until(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    return f"in {format_duration(ts - now)}" if ts > now else "due"


def utc(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def thousands(n: int) -> str:
    return f"{n:,}".replace(",", "\u2009")  # thin space: digits group without looking like decimals


def counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"


def attention(nodes: Sequence[NodeInfo]) -> list[tuple[NodeInfo, str, str]]:
    """Nodes an operator should look at, worst first (not ready, unhealthy GPUs, draining, cordoned):
    (node, first reason, tone). A filter over the rows ``llmgw ctl nodes`` prints, not a new count."""
    ranked: list[tuple[int, NodeInfo, str, str]] = []
    for n in nodes:
        if n.state != "ready":
            ranked.append((0 if n.state == "lost" else 1, n, n.state, tone(n.state)))
        elif n.gpus_unhealthy:
            s = "s" if n.gpus_unhealthy > 1 else ""
            ranked.append((2, n, f"{n.gpus_unhealthy} unhealthy GPU{s}", "bad"))
        elif n.draining:
            ranked.append((3, n, "draining", "warn"))
        elif n.cordoned:
            ranked.append((4, n, "cordoned", "warn"))
    return [(n, why, t) for _, n, why, t in sorted(ranked, key=lambda r: r[0])]
