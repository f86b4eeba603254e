"""The ctl verbs through the real micro service: catalog apply/diff/show, marks, status, restart adoption."""

from __future__ import annotations

import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.catalog import Catalog
from llmgw_common.messages import Assignment, ClusterSettings, RoutingCatalog, ShardState, Webhook
from llmgw_common.subjects import ROUTING_CATALOG, Subjects
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlError, CtlUnavailable
from llmgw_runtime.natsserver import NatsServer
from tests.controlplane.cp_helpers import cp_settings, ctl_answers, start_cp
from tests.kit.agents import Beating, FakeAgent
from tests.kit.poll import eventually

BAD = """
models:
  - name: a
    engine: vllm
  - name: a
    engine: nope
  - name: c
    engine: llamacpp
    nodes: 2
  - name: d
    engine: sim
    colour: blue
"""

NEW = """
models:
  - name: small
    engine: sim
    replicas: 2
    gpu_class: H100-80GB
  - name: extra
    engine: sim
"""


async def test_invalid_catalog_refused_with_every_problem_and_old_kept(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    c = CtlClient(bus_nc, prefix)
    try:
        await ctl_answers(bus_nc, prefix)
        before = await c.catalog_show()
        with pytest.raises(CtlError) as ei:
            await c.catalog_apply(BAD)
        msg = ei.value.message
        assert len(msg.splitlines()) >= 6  # one problem a line
        for needle in (
            "needs a GPU",
            "duplicate name",
            "unknown engine 'nope'",
            "cannot span nodes",
            "unknown field",
            "the current one stays",
        ):
            assert needle in msg, needle
        after = await c.catalog_show()
        assert after.catalog == before.catalog and after.version == before.version
        with pytest.raises(CtlError, match="not valid YAML"):
            await c.catalog_diff("models: [")
    finally:
        await run.stop()


async def test_valid_catalog_swaps_stores_pushes_and_reconciles(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    c = CtlClient(bus_nc, prefix)
    agent = FakeAgent(bus_nc, prefix, "gpu-0")
    beating = Beating([agent], 0.1)
    try:
        await agent.send_inventory()
        beating.start()
        await ctl_answers(bus_nc, prefix)
        diff = await c.catalog_diff(NEW)
        assert diff.added == ("extra",) and diff.removed == ("cpu-model",)
        (ch,) = diff.changed
        assert ch.name == "small" and [(f.field, f.old, f.new) for f in ch.changes] == [
            ("replicas", "1", "2")
        ]
        v0 = (await c.catalog_show()).version
        reply = await c.catalog_apply(NEW)
        assert reply.version == v0 + 1 and reply.diff == diff
        shown = await c.catalog_show()
        assert shown.catalog.names == ("small", "extra") and "extra" in shown.yaml
        # Stored in llmgw_desired and pushed to routers.
        js = bus_nc.jetstream()
        subj = Subjects(prefix)
        stored, _ = await bus.kv_get(await js.key_value(subj.bucket_desired), "catalog", Catalog)
        assert stored is not None and stored.names == ("small", "extra")
        rc, _ = await bus.kv_get(await js.key_value(subj.bucket_routing), ROUTING_CATALOG, RoutingCatalog)
        assert rc is not None and rc.catalog.names == ("small", "extra")

        # Reconciled: two replicas of small and one of extra assigned; cpu-model gone.
        akv = await js.key_value(subj.bucket_assign)

        async def models_assigned() -> bool:
            a, _ = await bus.kv_get(akv, "gpu-0", Assignment)
            return a is not None and sorted(s.model for s in a.shards) == ["extra", "small", "small"]

        await eventually(models_assigned, what="two replicas of small and one of extra assigned to gpu-0")
        models = {m.name: m for m in (await c.models()).models}
        assert set(models) == {"small", "extra"}
        assert models["small"].desired == 2 and models["small"].ready == 0
        assert models["small"].reason and "starting" in models["small"].reason
    finally:
        await beating.stop()
        await run.stop()


@pytest.mark.slow
async def test_marks_status_settings_and_errors(nats_server: NatsServer, prefix: str, bus_nc: NATS) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix))
    c = CtlClient(bus_nc, prefix)
    agents = [
        FakeAgent(bus_nc, prefix, "gpu-0", unhealthy={3: "XID 79"}),
        FakeAgent(bus_nc, prefix, "gpu-1", fabric="ib-b"),
    ]
    beating = Beating(agents, 0.1)
    try:
        for a in agents:
            await a.send_inventory()
        beating.start()
        await eventually(
            lambda: run.cp.leader and len(run.cp.state.replicas) == 2,
            what="a leading control plane with both replicas placed",
        )
        await ctl_answers(bus_nc, prefix)
        r = await c.cordon("gpu-1")
        assert r.marks.cordoned == ("gpu-1",)
        nodes = {n.name: n for n in (await c.nodes()).nodes}
        assert nodes["gpu-1"].cordoned and not nodes["gpu-0"].cordoned
        assert nodes["gpu-0"].gpus_unhealthy == 1 and nodes["gpu-0"].unhealthy_reasons == ("GPU 3: XID 79",)
        assert nodes["gpu-0"].gpus_used + nodes["gpu-0"].gpus_free == 7  # the unhealthy one is neither
        r = await c.drain("gpu-0", grace_s=60)
        assert "gpu-0" in r.marks.draining
        r = await c.uncordon("gpu-0")
        assert "gpu-0" not in r.marks.draining and r.marks.cordoned == ("gpu-1",)
        with pytest.raises(CtlError, match="no node named 'nope'"):
            await c.cordon("nope")
        with pytest.raises(CtlError, match="not in the catalog"):
            await c.explain_placement("nope")
        ex = await c.explain_placement("small")
        assert ex.nodes and ex.model == "small"

        st = await c.status()
        (cap,) = st.capacity
        assert (cap.gpu_class, cap.total, cap.unhealthy) == ("H100-80GB", 16, 1)
        assert cap.used == 1 and cap.free == 14 - 8  # gpu-1 is cordoned: its GPUs are not free
        assert any("no webhook" in w for w in st.warnings)
        assert st.leader and st.fence > 0
        await c.settings_set(ClusterSettings(webhooks=(Webhook(url="http://example.invalid/hook"),)))
        assert (await c.settings_get()).settings.webhooks[0].url == "http://example.invalid/hook"
        st = await c.status()
        assert not any("no webhook" in w for w in st.warnings)
        stats = await c.debug_stats()
        assert stats.leader and stats.passes > 0 and stats.nodes == 2 and stats.heartbeats > 0
    finally:
        await beating.stop()
        await run.stop()


async def test_no_control_plane_is_a_clear_error(bus_nc: NATS, prefix: str) -> None:
    # Nobody subscribed: the server says so at once (no responders), and the message says that, not a
    # time limit (a takeover's gap read as "within 20s" sent people looking for a slow control plane).
    t0 = time.monotonic()
    with pytest.raises(CtlUnavailable) as ei:
        await CtlClient(bus_nc, prefix, timeout=30).nodes()
    assert time.monotonic() - t0 < 10
    assert ei.value.message.startswith(f"no control plane answered on {prefix}.ctl.nodes: none is serving it")
    assert "within 30s" not in ei.value.message


async def test_a_silent_control_plane_is_named_by_the_time_waited(bus_nc: NATS, prefix: str) -> None:
    sub = await bus_nc.subscribe(Subjects(prefix).ctl("nodes"))  # takes requests, never answers
    await bus.flush(bus_nc)
    try:
        with pytest.raises(
            CtlUnavailable, match=rf"no control plane answered on {prefix}\.ctl\.nodes within 0\.3s"
        ):
            await CtlClient(bus_nc, prefix, timeout=0.3).nodes()
    finally:
        await sub.unsubscribe()


@pytest.mark.slow
async def test_restart_adopts_replicas_and_changes_no_assignment(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    s = cp_settings(nats_server.url, prefix, settle_s=0.5)
    run = await start_cp(s)
    agents = [FakeAgent(bus_nc, prefix, f"gpu-{i}") for i in range(2)]
    beating = Beating(agents, 0.1)
    akv = await bus_nc.jetstream().key_value(Subjects(prefix).bucket_assign)
    try:
        for a in agents:
            await a.send_inventory()
        beating.start()

        async def snapshot_assign() -> dict[str, int | None]:
            out = {}
            for k in await bus.kv_keys(akv):
                e = await akv.get(k)
                out[k] = e.revision
            return out

        await eventually(
            lambda: len(run.cp.state.replicas) == 2 and run.cp.assignments.writes >= 1,
            what="both replicas placed and their assignments written",
        )
        by_node = {a.node: a for a in agents}
        for rec in run.cp.state.replicas.values():
            sp = rec.shards[0]
            await by_node[sp.node].report(rec.id, 0, rec.model, ShardState.READY, sp.port)
        await eventually(lambda: run.cp.debug_stats().ready_replicas == 2, what="both replicas counted ready")
        revs = await snapshot_assign()
        ids = set(run.cp.state.replicas)
        await run.stop()

        run = await start_cp(s, catalog_text=None)
        await eventually(
            lambda: run.cp.leader and run.cp.passes > 3,
            timeout=10,
            what="the restarted control plane to lead and reconcile three passes",
        )
        assert set(run.cp.state.replicas) == ids
        assert await snapshot_assign() == revs  # not one assignment rewritten
        assert run.cp.debug_stats().ready_replicas == 2
    finally:
        await beating.stop()
        await run.stop()
