"""The console's usage history page (admin/usage_history.py) over a real nats-server's usage ledger:
a chart per key, busiest first, bars per day or hour with the ledger's sums, bad queries refused
saying what; and the pure chart function."""

from __future__ import annotations

import re

import httpx
from fastapi import FastAPI
from nats.aio.client import Client as NATS

from llmgw_common.codec import encode
from llmgw_common.messages import UsageHour
from llmgw_common.subjects import Subjects
from llmgw_controlplane.admin.usage_history import add_usage_history_route, charts, groups_between
from llmgw_runtime import bus
from llmgw_runtime.usage_ledger import HOUR, By, UsageRow, ledger_key, read_hours

NOW = 1_796_000_000.0  # 2026-11-30T00:53:20Z: the page's clock


def test_charts_put_every_group_on_the_keys_own_scale_busiest_first() -> None:
    rows = [UsageRow("a", "2026-12-01", 2, 10, 10), UsageRow("b", "2026-11-30", 1, 50, 50)]
    got = charts(rows, {"a": "team-a"}, ["2026-11-30", "2026-12-01"])
    assert [c.key_id for c in got] == ["b", "a"]
    assert [(x.label, x.tokens, x.height) for x in got[1].bars] == [
        ("2026-11-30", 0, 0.0),
        ("2026-12-01", 20, 40.0),
    ]
    assert (got[1].name, got[0].name) == ("team-a", "-")
    hours = groups_between(NOW - 3 * HOUR, NOW, By.HOUR)
    assert hours == ["2026-11-29T21", "2026-11-29T22", "2026-11-29T23", "2026-11-30T00"]


async def test_the_page_charts_the_ledger_per_key(nc: NATS, prefix: str) -> None:
    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_usage)
    h = (NOW // HOUR) * HOUR
    for hour in (
        UsageHour(router="r0", since=1.0, hour=h, written_at=h, usage={"k1": {"m": (3, 300, 30)}, "k2": {"m": (1, 5, 5)}}),
        UsageHour(router="r1", since=1.0, hour=h - 2 * HOUR, written_at=h, usage={"k1": {"m": (1, 100, 10)}}),
    ):  # fmt: skip
        await kv.put(ledger_key(hour.hour, hour.router, hour.since), encode(hour))

    async def names() -> dict[str, str]:
        return {"k1": "batch", "k2": "chat"}

    app = FastAPI()
    add_usage_history_route(app, lambda since: read_hours(kv, since), names, clock=lambda: NOW)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
        page = await c.get("/usage/history", params={"since": "24h", "by": "hour"})
        assert page.status_code == 200
        text = page.text
        # Busiest first, totals from both routers' hours; one bar per hour of the 24.
        assert text.index("batch (k1)") < text.index("chat (k2)")
        assert "440" in text and text.count("<rect") == 2 * 25
        assert re.search(r"<title>\d{4}-\d\d-\d\dT\d\d: 330 tokens, 3 requests</title>", text)
        bad = await c.get("/usage/history", params={"since": "a week"})
        assert bad.status_code == 400 and "'a week' is not a duration" in bad.text
        assert (await c.get("/usage/history", params={"by": "model"})).status_code == 400
