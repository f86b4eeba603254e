"""The console over a live control plane (real nats-server, fake agents): it shows the fleet, and its
numbers are the ones ``llmgw ctl`` gets over the bus at the same moment."""

from __future__ import annotations

import time

import httpx
from console_live import LIVE_UNHEALTHY, LiveConsole, eventually
from test_console_http import rows, text

from llmgw_common.ctl import StatusReply
from llmgw_common.messages import ClusterSettings, UsageReport, Webhook


async def _settled(live: LiveConsole) -> StatusReply:
    """Wait until all four nodes reported, llama-8b is ready and giant is known unplaceable."""

    async def check() -> StatusReply | None:
        s = await live.ctl.status()
        ok = (
            s.nodes_by_state.get("ready") == 4
            and s.models_by_state.get("ok") == 2
            and [u.model for u in s.unplaceable] == ["giant"]
            and s.replicas_by_state.get("ready") == 2
        )
        return s if ok else None

    return await eventually(check, timeout=15)


async def test_live_console_matches_ctl(live_console: LiveConsole):
    live = live_console
    await _settled(live)
    async with httpx.AsyncClient(base_url=live.url) as c:
        # The fleet is static now (only heartbeats flow), so ctl and the page see the same state.
        status = await live.ctl.status()
        page = (await c.get("/")).text
        cap = rows(page, "capacity")[1:]
        assert len(cap) == len(status.capacity) == 2
        for cc, row in zip(status.capacity, cap, strict=True):
            assert cc.held == cc.total - cc.used - cc.free - cc.unhealthy
            assert row == f"{cc.gpu_class} {cc.used} {cc.free} {cc.unhealthy} {cc.held} {cc.total}"
        h100 = next(cc for cc in status.capacity if cc.gpu_class == "H100-80GB")
        assert (h100.total, h100.used, h100.unhealthy, h100.free) == (16, 2, 1, 13)
        assert rows(page, "free-nodes") == [f"{f} {n}" for f, n in status.free_nodes_per_fabric.items()]
        assert [r.split(" ", 1)[0] for r in rows(page, "unplaceable")[1:]] == ["giant"]
        assert status.unplaceable[0].reason in text(page)
        assert rows(page, "weights")[1:] == ["ib-a llama-8b"]  # shared storage: once per fabric
        assert 'id="webhook-warning"' in page and "llmgw setup --webhook URL" in page

        nodes_page = (await c.get("/nodes")).text
        ctl_nodes = (await live.ctl.nodes()).nodes
        page_nodes = rows(nodes_page, "nodes")[1:]
        assert [r.split()[0] for r in page_nodes] == [n.name for n in ctl_nodes]
        for n, row in zip(ctl_nodes, page_nodes, strict=True):
            if n.gpus_total:
                assert f"{n.gpus_used}/{n.gpus_free}/{n.gpus_held}/{n.gpus_unhealthy}/{n.gpus_total}" in row
        h1 = next(r for r in page_nodes if r.startswith("h100-01"))
        assert f"GPU 7: {LIVE_UNHEALTHY}" in h1
        a1 = next(r for r in page_nodes if r.startswith("a100-01"))
        assert "4xA100-40GB - 48" in a1  # memory not reported: "-"

        models_page = (await c.get("/models")).text
        assert [r.split()[0] for r in rows(models_page, "models")[1:]] == [
            m.name for m in (await live.ctl.models()).models
        ]
        replicas_page = (await c.get("/replicas")).text
        for r in (await live.ctl.replicas()).replicas:
            row = next(x for x in rows(replicas_page, "replicas")[1:] if x.startswith(r.id))
            assert r.idle == "-" and row.split()[-2] == "-"  # no router reports: unknown, not idle
        placement = (await c.get("/placement")).text
        assert "giant cannot be placed" in text(placement)
        # Refusals grouped by their exact reason: the two H100 nodes share one.
        assert "2 has no B200-192GB GPUs (has H100-80GB) h100-01, h100-02" in text(placement), text(placement)

        stats = (await c.get("/debug/stats")).json()
        assert stats["leader"] is True and stats["nodes"] == 4 and stats["passes"] > 0
        assert stats["console"]["requests"]["overview"] == 1


async def test_live_webhook_banner_follows_settings(live_console: LiveConsole):
    live = live_console
    async with httpx.AsyncClient(base_url=live.url) as c:
        assert 'id="webhook-warning"' in (await c.get("/")).text
        await live.ctl.settings_set(ClusterSettings(webhooks=(Webhook(url="https://hooks.example/x"),)))
        page = (await c.get("/")).text
    assert 'id="webhook-warning"' not in page
    assert "webhook" not in text(page)


async def test_live_usage_from_router_reports(live_console: LiveConsole):
    live = live_console
    async with httpx.AsyncClient(base_url=live.url) as c:
        assert "No usage reported yet" in text((await c.get("/usage")).text)
        now = time.time()
        await live.publish_usage(
            UsageReport(
                router="r-1", since=now - 60, sent_at=now, usage={"key-ops": {"llama-8b": (3, 300, 90)}}
            )
        )

        async def shown() -> str | None:
            page = (await c.get("/usage")).text
            return page if 'id="usage"' in page else None

        page = await eventually(shown)
    assert rows(page, "usage")[1:] == ["key-ops llama-8b 3 300 90 390"]


async def test_live_source_unavailable_when_nats_is_gone(live_console: LiveConsole):
    """The status verb reads settings from NATS: with the control plane's connection closed, the
    console answers 503 with the reason instead of a traceback."""
    live = live_console
    await live.cp.nc.close()
    async with httpx.AsyncClient(base_url=live.url) as c:
        r = await c.get("/")
    assert r.status_code == 503
    assert "could not read its state from NATS" in r.text
