"""Malformed messages on every subject and bucket of a real `llmgw up`: dropped, and it keeps serving."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import nats
import psutil
import pytest
from aiohttp import web
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from llmgw_common.codec import encode
from llmgw_common.messages import ClusterSettings, Event, Webhook
from llmgw_common.subjects import DESIRED_SETTINGS, ROUTING_CATALOG, ROUTING_ENDPOINTS, Subjects
from llmgw_runtime import bus
from tests.e2e.e2e_cluster import Cluster, chat_once, shown_on_failure, wait_model
from tests.kit.poll import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e")]

# Not msgpack; msgpack but not a map; a map of another schema version; this version, wrong fields.
GARBAGE = (
    b"\xc1\xc1 not msgpack",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"_v": 99, "node": "gpu-a1"}),
    msgpack.packb({"_v": 1, "node": 5, "seq": "many", "shards": "none"}),
)


def log_sizes(cluster: Cluster) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in cluster.logs_dir.glob("*.log")}


def new_text(cluster: Cluster, name: str, since: dict[str, int]) -> str:
    with open(cluster.logs_dir / name, "rb") as f:
        f.seek(since.get(name, 0))
        return f.read().decode("utf-8", "replace")


async def garble_key(kv: KeyValue, key: str) -> tuple[bytes | None, int]:
    """Put garbage over ``key``; returns its previous value and the garbage's revision."""
    try:
        old = (await kv.get(key)).value
    except nats.js.errors.NotFoundError:
        old = None
    rev = await kv.put(key, GARBAGE[3])
    return old, rev


async def restore_key(kv: KeyValue, key: str, old: bytes | None, rev: int) -> None:
    """Put the old value back unless its owner already rewrote the key (compare and set)."""
    try:
        if old is None:
            await kv.delete(key, last=rev)
        else:
            await kv.update(key, old, last=rev)
    except nats.js.errors.KeyWrongLastSequenceError:
        pass


async def test_malformed_messages_are_dropped_and_the_cluster_keeps_serving(cluster: Cluster) -> None:
    # The cluster's helpers poll with blocking HTTP: in a thread, not on this test's loop.
    await asyncio.to_thread(wait_model, cluster, "tiny-cpu")
    await asyncio.to_thread(wait_model, cluster, "qwen2.5-coder-7b")
    s = Subjects(cluster.prefix)
    since = log_sizes(cluster)
    nc = await nats.connect(cluster.nats_url)
    try:
        js = nc.jetstream()
        core = [
            s.heartbeat("gpu-a1"),
            s.inventory("gpu-a1"),
            s.status("gpu-a1"),
            s.load("gpu-a1"),
            s.heartbeat("ghost"),
            s.inventory("ghost"),
            s.idle("dev"),
            s.idle("ghost"),
            s.usage("dev"),
        ]
        for subject in core:
            for g in GARBAGE:
                await nc.publish(subject, g)
        await bus.flush(nc)
        routing = await js.key_value(s.bucket_routing)
        assign = await js.key_value(s.bucket_assign)
        keys = await js.key_value(s.bucket_keys)
        saved = {
            (routing, ROUTING_CATALOG): await garble_key(routing, ROUTING_CATALOG),
            (routing, ROUTING_ENDPOINTS): await garble_key(routing, ROUTING_ENDPOINTS),
            (assign, "gpu-b1"): await garble_key(assign, "gpu-b1"),
        }
        await keys.put("garbage", GARBAGE[0])

        # Each receiver says, once per message, that it dropped it; none crashes.
        expect = {
            "controlplane.log": [
                s.heartbeat("gpu-a1"),
                s.inventory("gpu-a1"),
                s.status("gpu-a1"),
                s.idle("dev"),
            ],
            "router.log": [
                s.load("gpu-a1"),
                f"{s.bucket_routing}/{ROUTING_CATALOG}",
                f"{s.bucket_routing}/{ROUTING_ENDPOINTS}",
                f"{s.bucket_keys}/garbage",
            ],
            "agent-gpu-b1.log": [f"{s.bucket_assign}/gpu-b1"],
        }
        missing: list[str] = []

        def all_logged() -> bool:
            nonlocal missing
            missing = [
                f"{log}: {where}"
                for log, wheres in expect.items()
                for where in wheres
                if f"dropped undecodable message on {where}:" not in new_text(cluster, log, since)
            ]
            return not missing

        with shown_on_failure(lambda: f"no drop logged for {missing}\n{cluster.diagnostics()}"):
            await eventually(
                all_logged, timeout=30.0, every=0.5, what="every service to log each dropped message"
            )
        cp = new_text(cluster, "controlplane.log", since)
        assert cp.count(f"dropped undecodable message on {s.heartbeat('gpu-a1')}:") == len(GARBAGE)

        # Served while the garbage is in place: the routers kept their last good tables, gpu-b1 its engines.
        for model in ("tiny-cpu", "qwen2.5-coder-7b", "llama-3.1-8b"):
            r = await asyncio.to_thread(chat_once, cluster, model)
            assert r.status_code == 200, f"{model}: {r.status_code} {r.text}"
        for (kv, key), (old, rev) in saved.items():
            await restore_key(kv, key, old, rev)
        await keys.delete("garbage")
    finally:
        await nc.close()

    # Still serving after, every process of the run alive, no traceback in any log.
    await asyncio.to_thread(wait_model, cluster, "qwen2.5-coder-7b", timeout=30)
    state = json.loads((cluster.data_dir / "up.json").read_text())
    dead = [c["name"] for c in state["children"] if not psutil.pid_exists(c["pid"])]
    assert not dead, cluster.diagnostics()
    for name in log_sizes(cluster):
        assert "Traceback" not in new_text(cluster, name, since), f"{name}:\n{new_text(cluster, name, since)}"


def test_logs_are_where_up_said(cluster: Cluster) -> None:
    names = {p.name for p in Path(cluster.logs_dir).glob("*.log")}
    assert {"nats.log", "controlplane.log", "router.log", "notifier.log", "agent-local.log"} <= names
    assert {"agent-gpu-a1.log", "agent-gpu-a2.log", "agent-gpu-b1.log"} <= names


async def test_malformed_events_are_dropped_and_the_next_event_is_delivered(cluster: Cluster) -> None:
    """The notifier reads events only for a configured webhook: configure one, garble the stream, then send."""
    got: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def hook(req: web.Request) -> web.Response:
        got.append(await req.json())
        arrived.set()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s = Subjects(cluster.prefix)
    since = log_sizes(cluster)
    nc = await nats.connect(cluster.nats_url)
    try:
        js = nc.jetstream()
        desired = await js.key_value(s.bucket_desired)
        try:
            old_settings: bytes | None = (await desired.get(DESIRED_SETTINGS)).value
        except nats.js.errors.NotFoundError:
            old_settings = None
        hooked = ClusterSettings(webhooks=(Webhook(url=f"http://127.0.0.1:{port}/hook"),))
        await desired.put(DESIRED_SETTINGS, encode(hooked))

        async def notifier_consumes() -> bool:
            return bool([c async for c in _consumers(js, s.events_stream) if "notifier" in c])

        with shown_on_failure(cluster.diagnostics):
            await eventually(
                notifier_consumes, timeout=30.0, every=0.3, what="the notifier to make its events consumer"
            )

        for g in GARBAGE:
            await js.publish(s.event("node.lost"), g)
        ev = Event(
            id=f"e2e-{time.time_ns()}", kind="model.down", subject="e2e-model", time=time.time(), summary="x"
        )
        await js.publish(s.event(ev.kind), encode(ev))
        await asyncio.wait_for(arrived.wait(), 60)
        assert ev.id in json.dumps(got)
        drops = new_text(cluster, "notifier.log", since).count(
            f"dropped undecodable message on {s.event('node.lost')}:"
        )
        assert drops == len(GARBAGE)
        if old_settings is None:
            await desired.delete(DESIRED_SETTINGS)
        else:
            await desired.put(DESIRED_SETTINGS, old_settings)
    finally:
        await nc.close()
        await runner.cleanup()


async def _consumers(js: JetStreamContext, stream: str) -> AsyncIterator[str]:
    for c in await js.consumers_info(stream):
        yield c.name
