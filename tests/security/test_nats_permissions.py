"""The generated per-role NATS users, enforced by a real nats-server (issue 9)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from llmgw_common import bus
from llmgw_common.codec import encode
from llmgw_common.messages import Assignment, Heartbeat
from llmgw_common.natsauth import Role, all_roles, authorization_config
from llmgw_common.natsserver import NatsServer
from llmgw_common.settings import BusSettings
from llmgw_common.subjects import Subjects

PREFIX = "llmgw"
SUBJ = Subjects(PREFIX)


@pytest.fixture(scope="module")
def roles() -> dict[str, Role]:
    return {r.user: r for r in all_roles(SUBJ, ["gpu-a1", "gpu-a2"])}


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory: pytest.TempPathFactory, roles: dict[str, Role]) -> Iterator[NatsServer]:
    d: Path = tmp_path_factory.mktemp("secnats")
    conf = d / "auth.conf"
    conf.write_text(authorization_config(list(roles.values())))
    srv = NatsServer(d, config_file=str(conf))
    srv.start()
    yield srv
    srv.stop()


async def _connect(srv: NatsServer, role: Role) -> nats.aio.client.Client:
    s = BusSettings(
        nats_urls=[srv.url],
        prefix=PREFIX,
        nats_user=role.user,
        nats_password=role.password,
        nats_inbox_prefix=role.inbox_prefix,
    )
    return await bus.connect(s, role.user, wait=False)


@pytest.fixture
async def clients(secured_server: NatsServer, roles: dict[str, Role]) -> AsyncIterator[dict[str, object]]:
    out = {
        name: await _connect(secured_server, roles[name])
        for name in ("controlplane", "agent-gpu-a1", "router")
    }
    cp = out["controlplane"]
    await bus.ensure_all(cp.jetstream(), SUBJ)  # type: ignore[attr-defined]
    yield out
    for c in out.values():
        await c.close()  # type: ignore[attr-defined]


async def _received(nc, subject: str, publish) -> list[bytes]:  # type: ignore[no-untyped-def]
    got: list[bytes] = []

    async def cb(m) -> None:  # type: ignore[no-untyped-def]
        got.append(m.data)

    sub = await nc.subscribe(subject, cb=cb)
    await bus.sent(nc)
    await publish()
    await asyncio.sleep(0.3)
    await sub.unsubscribe()
    return got


async def test_agent_publishes_its_own_heartbeat_only(clients) -> None:
    cp, agent = clients["controlplane"], clients["agent-gpu-a1"]
    hb = encode(Heartbeat(node="gpu-a1", boot_id="b", seq=1, sent_at=1.0))

    async def pub_own() -> None:
        await agent.publish(SUBJ.heartbeat("gpu-a1"), hb)
        await agent.flush()

    async def pub_other() -> None:
        await agent.publish(SUBJ.heartbeat("gpu-a2"), hb)
        await agent.flush()

    assert await _received(cp, SUBJ.heartbeat("gpu-a1"), pub_own) == [hb]
    # A permission violation only reaches error_cb: the proof is that nothing arrives.
    assert await _received(cp, SUBJ.heartbeat("gpu-a2"), pub_other) == []


async def test_agent_reads_its_own_assignment_and_cannot_write_one(clients) -> None:
    cp, agent = clients["controlplane"], clients["agent-gpu-a1"]
    cp_kv = await cp.jetstream().key_value(SUBJ.bucket_assign)
    await cp_kv.put("gpu-a1", encode(Assignment(node="gpu-a1", fence=1)))
    await cp_kv.put("gpu-a2", encode(Assignment(node="gpu-a2", fence=1)))

    kv = await agent.jetstream(timeout=1.0).key_value(SUBJ.bucket_assign)
    entry = await kv.get("gpu-a1")
    assert entry.value is not None
    with pytest.raises((nats.errors.TimeoutError, KeyNotFoundError, nats.errors.Error)):
        await kv.get("gpu-a2")
    with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
        await kv.put("gpu-a1", encode(Assignment(node="gpu-a1", fence=99)))
    # The control plane's value is untouched.
    assert (await cp_kv.get("gpu-a1")).revision == entry.revision


async def test_router_cannot_write_assignments_or_desired_state(clients) -> None:
    router = clients["router"]
    js = router.jetstream(timeout=1.0)
    for bucket in (SUBJ.bucket_assign, SUBJ.bucket_desired, SUBJ.bucket_keys):
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            kv = await js.key_value(bucket)
            await kv.put("x", b"y")


async def test_router_can_read_routing(clients) -> None:
    cp, router = clients["controlplane"], clients["router"]
    await (await cp.jetstream().key_value(SUBJ.bucket_routing)).put("catalog", b"v1")
    kv = await router.jetstream(timeout=2.0).key_value(SUBJ.bucket_routing)
    assert (await kv.get("catalog")).value == b"v1"


async def test_notifier_and_router_can_bind_every_bucket_but_write_none(
    secured_server, roles, clients
) -> None:
    for name in ("notifier", "router"):
        nc = await _connect(secured_server, roles[name])
        try:
            js = nc.jetstream(timeout=2.0)
            buckets = await bus.ensure_all(js, SUBJ)  # binds: every bucket exists already
            assert len(buckets) == 6
            with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
                await buckets[SUBJ.bucket_desired].put("settings", b"x")
        finally:
            await nc.close()


async def test_an_agent_that_may_not_watch_still_follows_its_assignment(clients) -> None:
    """The agent role reads its key by direct get only; without a watch the follower polls often."""
    cp, agent = clients["controlplane"], clients["agent-gpu-a1"]
    cp_kv = await cp.jetstream().key_value(SUBJ.bucket_assign)
    await cp_kv.put("gpu-a1", encode(Assignment(node="gpu-a1", fence=1)))
    kv = await agent.jetstream(timeout=1.0).key_value(SUBJ.bucket_assign)
    seen: list[bytes | None] = []
    f = bus.KvFollower(kv, lambda k, v, r: seen.append(v), key="gpu-a1", resync_s=60)
    await f.start()
    try:
        assert len(seen) == 1
        new = encode(Assignment(node="gpu-a1", fence=2))
        await cp_kv.put("gpu-a1", new)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 8
        while new not in seen and loop.time() < deadline:
            await asyncio.sleep(0.1)
        assert new in seen and not f.watching
    finally:
        await f.stop()
