"""The console's usage history: ``GET /usage/history?since=7d&by=day`` (or ``by=hour``), a chart per
key over time from the durable usage ledger (KV ``<prefix>_usage``, ``llmgw_runtime.usage_ledger``),
what ``llmgw keys usage`` reads. The charts are inline SVG (the console's CSP runs no script)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse
from nats.aio.client import Client as NATS

from llmgw_common.durations import parse_duration
from llmgw_common.messages import UsageHour
from llmgw_controlplane.admin.app import REFRESH_S, _environment
from llmgw_runtime.usage_ledger import By, UsageRow, fold

# What the page reads: the ledger's hours from a time on, and key id -> name.
ReadHours = Callable[[float], Awaitable[list[UsageHour]]]
KeyNames = Callable[[], Awaitable[dict[str, str]]]
MAX_KEYS = 50  # the busiest keys get a chart each; the page says how many were left out


@dataclass(frozen=True, slots=True)
class Bar:
    label: str  # the day or hour
    tokens: int
    requests: int
    x: float
    height: float


@dataclass(frozen=True, slots=True)
class KeyChart:
    key_id: str
    name: str
    tokens: int
    requests: int
    bars: list[Bar]


def charts(rows: list[UsageRow], names: dict[str, str], groups: list[str]) -> list[KeyChart]:
    """One chart per key, every group (day or hour) a bar, heights on the key's own scale; busiest
    key first. Pure: the page's numbers are these."""
    per: dict[str, dict[str, UsageRow]] = {}
    for r in rows:
        per.setdefault(r.key_id, {})[r.group] = r
    out = []
    width = 100.0 / max(1, len(groups))
    for kid, by_group in per.items():
        top = max(r.total_tokens for r in by_group.values()) or 1
        bars = []
        for i, g in enumerate(groups):
            hit = by_group.get(g)
            tok, req = (hit.total_tokens, hit.requests) if hit is not None else (0, 0)
            bars.append(Bar(g, tok, req, i * width, 40.0 * tok / top))
        out.append(
            KeyChart(
                kid,
                names.get(kid, "-"),
                sum(r.total_tokens for r in by_group.values()),
                sum(r.requests for r in by_group.values()),
                bars,
            )
        )
    out.sort(key=lambda c: (-c.tokens, c.key_id))
    return out


def groups_between(start: float, end: float, by: By) -> list[str]:
    step = 86400.0 if by is By.DAY else 3600.0
    fmt = "%Y-%m-%d" if by is By.DAY else "%Y-%m-%dT%H"
    t, out = (start // step) * step, []
    while t < end:
        out.append(time.strftime(fmt, time.gmtime(t)))
        t += step
    return out


def add_usage_history_route(
    app: FastAPI, read: ReadHours, names: KeyNames, clock: Callable[[], float] = time.time
) -> None:
    env = _environment()

    async def page(
        since: str = Query("7d", description="How far back: 24h, 7d, 30d"),
        by: By = Query(By.DAY, description="day or hour"),
    ) -> HTMLResponse:
        if by is By.MODEL:
            return HTMLResponse(
                "by: day or hour (per model: `llmgw keys usage --by model`)\n", status_code=400
            )
        try:
            seconds = parse_duration(since)
        except ValueError:
            return HTMLResponse(f"since: {since!r} is not a duration (use e.g. 24h, 7d)\n", status_code=400)
        if not 0 < seconds <= 400 * 86400:
            return HTMLResponse("since: between 1s and 400d\n", status_code=400)
        now = clock()
        start = now - seconds
        rows = fold(await read(start), by, start)
        all_charts = charts(rows, await names(), groups_between(start, now, by))
        html = env.get_template("usage_history.html").render(
            page="usage",
            title="Usage history",
            status=None,
            now=now,
            refresh_s=REFRESH_S * 6,
            since=since,
            by=by.value,
            charts=all_charts[:MAX_KEYS],
            left_out=max(0, len(all_charts) - MAX_KEYS),
        )
        return HTMLResponse(html)

    app.add_api_route("/usage/history", page, methods=["GET"], response_class=HTMLResponse)


def ledger_readers(nc: NATS, prefix: str) -> tuple[ReadHours, KeyNames]:
    """The page's readers over the bus: the ledger bucket and the key records, bound per request (a
    control plane started before any router made the bucket still shows it once it exists)."""
    from llmgw_common.subjects import Subjects
    from llmgw_runtime import bus
    from llmgw_runtime.apikeys import list_keys
    from llmgw_runtime.usage_ledger import read_hours

    async def read(since: float) -> list[UsageHour]:
        kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
        return await read_hours(kv, since)

    async def names() -> dict[str, str]:
        return {r.id: r.name for r in await list_keys(nc, prefix)}

    return read, names
