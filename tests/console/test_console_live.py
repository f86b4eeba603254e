"""The console over a live control plane (real nats-server, fake agents): its numbers are computed by
the real handlers, and checked against the fleet the test built."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from llmgw_common.ctl import StatusReply
from llmgw_common.messages import Assignment, ClusterSettings, Webhook
from llmgw_common.router_messages import UsageReport
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from tests.console.console_live import LIVE_UNHEALTHY, LiveConsole
from tests.console.console_pages import rows, text
from tests.http_clients import async_client
from tests.kit.poll import eventually


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

    settled = await eventually(
        check, timeout=15, what="four ready nodes, llama-8b and qwen-cpu ready, giant unplaceable"
    )
    assert settled is not None  # eventually returns only a truthy value
    return settled


async def _assigned_gpus(live: LiveConsole) -> dict[str, set[int]]:
    """GPU indexes each node was assigned, read from the bus (what the agents were told to run)."""
    kv = await live.nc.jetstream().key_value(Subjects(live.prefix).bucket_assign)
    out: dict[str, set[int]] = {}
    for a in live.agents:
        assignment, _ = await bus.kv_get(kv, a.node, Assignment)
        out[a.node] = {g for sh in (assignment.shards if assignment else ()) for g in sh.gpus}
    return out


def _expected_capacity(live: LiveConsole, used: dict[str, set[int]]) -> list[str]:
    """The overview's capacity rows computed from the fleet the test built: the agents' inventories and
    the assignments; every node is ready and none cordoned, so nothing is "held"."""
    cap: dict[str, Counter[str]] = {}
    for a in live.agents:
        for g in a.inventory.gpus:
            c = cap.setdefault(g.gpu_class, Counter())
            c["total"] += 1
            if not g.healthy:
                c["unhealthy"] += 1  # neither used nor free (ARCHITECTURE #2)
            elif g.index in used[a.node]:
                c["used"] += 1
            else:
                c["free"] += 1
    return [f"{k} {v['used']} {v['free']} {v['unhealthy']} 0 {v['total']}" for k, v in sorted(cap.items())]


@pytest.mark.slow
async def test_live_console_shows_what_the_fleet_holds(live_console: LiveConsole) -> None:
    """The pages' numbers against the fleet the test built (inventories, catalog, assignments), not
    against the ctl replies: ctl and the console share the view code, so comparing them with each other
    could not catch a broken view."""
    live = live_console
    await _settled(live)
    # On a loaded machine a fake agent's heartbeat can be late and the fleet change under the test for a
    # moment: compare again until one read of the assignments and the pages agree, or fail with the
    # last difference (a broken view never agrees).
    await eventually(
        lambda: _compare_with_fleet(live),
        timeout=20,
        every=0.2,
        what="the console pages to agree with the fleet's inventories and assignments",
        tolerate=(AssertionError,),
    )


async def _compare_with_fleet(live: LiveConsole) -> bool:
    """True when every page agrees with the fleet; otherwise an AssertionError naming the difference."""
    used = await _assigned_gpus(live)
    # llama-8b takes 2 healthy H100s on one node; qwen-cpu runs on the CPU node.
    assert sorted(len(g) for g in used.values()) == [0, 0, 0, 2]
    inv = {a.node: a.inventory for a in live.agents}
    async with async_client(base_url=live.url) as c:
        page = (await c.get("/")).text
        assert rows(page, "capacity")[1:] == _expected_capacity(live, used)
        # A node whose healthy GPUs are all free counts as a free node of its fabric (the unhealthy
        # h100-01 still can, if nothing runs there); the CPU node has no GPU: not a free GPU node.
        free_nodes = Counter(
            i.fabric or "-"
            for n, i in inv.items()
            if i.gpus and not any(g.index in used[n] for g in i.gpus if g.healthy)
        )
        assert rows(page, "free-nodes") == [f"{f} {k}" for f, k in sorted(free_nodes.items())]
        assert [r.split(" ", 1)[0] for r in rows(page, "unplaceable")[1:]] == ["giant"]
        assert "has no B200-192GB GPUs" in text(page)
        assert rows(page, "weights")[1:] == ["ib-a llama-8b"]  # shared storage: once per fabric
        assert "nodes ready 4" in text(page)
        assert "models ok 2 unplaceable 1" in text(page)
        assert 'id="webhook-warning"' in page and "llmgw setup --webhook URL" in page

        nodes_page = (await c.get("/nodes")).text
        page_nodes = {r.split()[0]: r for r in rows(nodes_page, "nodes")[1:]}
        assert sorted(page_nodes) == sorted(inv)
        for name, i in inv.items():
            if i.gpus:
                bad = sum(1 for g in i.gpus if not g.healthy)
                n_used = len(used[name])
                counts = f"{n_used}/{len(i.gpus) - n_used - bad}/0/{bad}/{len(i.gpus)}"  # u/f/held/x/t
                assert counts in page_nodes[name], (name, counts, page_nodes[name])
        assert f"GPU 7: {LIVE_UNHEALTHY}" in page_nodes["h100-01"]
        assert "4xA100-40GB - 48" in page_nodes["a100-01"]  # memory not reported: "-"

        models_page = (await c.get("/models")).text
        assert sorted(r.split()[0] for r in rows(models_page, "models")[1:]) == [
            "giant",
            "llama-8b",
            "qwen-cpu",
        ]
        replicas_page = (await c.get("/replicas")).text
        reps = [r for r in rows(replicas_page, "replicas")[1:] if not r.startswith("shard ")]
        assert sorted(r.split()[1] for r in reps) == ["llama-8b", "qwen-cpu"]
        for row in reps:
            assert row.split()[-2] == "-"  # no router reports: unknown, not idle
        placement = (await c.get("/placement")).text
        assert "giant cannot be placed" in text(placement)
        # Refusals grouped by their exact reason: the two H100 nodes share one.
        assert "2 has no B200-192GB GPUs (has H100-80GB) h100-01, h100-02" in text(placement), text(placement)

        stats = (await c.get("/debug/stats")).json()
        assert stats["leader"] is True and stats["nodes"] == len(inv) and stats["passes"] > 0
        assert stats["console"]["requests"]["overview"] >= 1
    return True


@pytest.mark.slow
async def test_live_webhook_banner_follows_settings(live_console: LiveConsole) -> None:
    live = live_console
    async with async_client(base_url=live.url) as c:
        assert 'id="webhook-warning"' in (await c.get("/")).text
        await live.ctl.settings_set(ClusterSettings(webhooks=(Webhook(url="https://hooks.example/x"),)))
        page = (await c.get("/")).text
    assert 'id="webhook-warning"' not in page
    assert "webhook" not in text(page)


@pytest.mark.slow
async def test_live_usage_from_router_reports(live_console: LiveConsole) -> None:
    live = live_console
    async with async_client(base_url=live.url) as c:
        assert "No usage reported yet" in text((await c.get("/usage")).text)
        now = time.time()
        await live.publish_usage(
            UsageReport(
                router="r-1", since=now - 60, sent_at=now, usage={"key-ops": {"llama-8b": (3, 300, 90)}}
            )
        )

        async def shown() -> str:
            page = (await c.get("/usage")).text
            return page if 'id="usage"' in page else ""

        page = await eventually(shown, what="the usage page to show the router's report")
    assert rows(page, "usage")[1:] == ["key-ops llama-8b 3 300 90 390"]


async def test_live_source_unavailable_when_nats_is_gone(live_console: LiveConsole) -> None:
    """The status verb reads settings from NATS: with the control plane's connection closed, the
    console answers 503 with the reason instead of a traceback."""
    live = live_console
    await live.cp.nc.close()
    async with async_client(base_url=live.url) as c:
        r = await c.get("/")
    assert r.status_code == 503
    assert "could not read its state from NATS" in r.text
