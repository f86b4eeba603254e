"""The generated per-role NATS users, enforced by a real nats-server (issue 9)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import encode
from llmgw_common.messages import Assignment, Heartbeat, UsageHour
from llmgw_common.natsauth import Role, all_roles, authorization_config
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.settings import BusSettings
from llmgw_runtime.usage_ledger import ledger_key, read_hours
from tests.kit.poll import eventually

PREFIX = "llmgw"
SUBJ = Subjects(PREFIX)
# Every bucket name Subjects declares (it holds every name llmgw uses): a bucket added there and
# forgotten by ensure_all, or by a role's bind grants, fails the binding test below.
# Every bucket ensure_all makes; the control planes' announced node state is theirs alone, made by
# the first leader (the test of it: tests/controlplane/test_cp_announced_nodes.py).
EVERY_BUCKET = sorted(
    getattr(SUBJ, n)
    for n in vars(Subjects)
    # The control planes' own bucket; the tokenizers are an object store (tests/common/test_natsauth_kv.py);
    # the key-name index is `llmgw keys`' own (routers and the notifier never read it).
    if n.startswith("bucket_") and n not in ("bucket_announced", "bucket_tokenizers", "bucket_key_names")
)


class Denials:
    """The server's permission violations as each client's error callback logged them (llmgw.bus).

    A denied publish is not an exception: the server drops it and sends ``-ERR``, which nats-py hands
    to ``error_cb`` (lowercased); a request on a denied subject then times out.
    """

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def of(self, client: str) -> list[str]:
        prefix = f"nats ({client}): nats: permissions violation for publish to "
        return [
            r.getMessage()[len(prefix) :].strip('"')
            for r in self.caplog.records
            if r.name == "llmgw.bus" and r.getMessage().startswith(prefix)
        ]

    async def wait(self, client: str, subject: str, timeout: float = 5.0) -> None:
        """Until the server refused ``client`` a publish to ``subject``: then it dropped that message."""
        await eventually(
            lambda: subject.lower() in self.of(client),
            timeout=timeout,
            every=0.02,
            what=f"the server to refuse {client} a publish to {subject}",
        )


@pytest.fixture
def denials(caplog: pytest.LogCaptureFixture) -> Denials:
    caplog.set_level(logging.WARNING, logger="llmgw.bus")
    return Denials(caplog)


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


async def _connect(srv: NatsServer, role: Role) -> NATS:
    s = BusSettings(
        nats_urls=[srv.url],
        prefix=PREFIX,
        nats_user=role.user,
        nats_password=role.password,
        nats_inbox_prefix=role.inbox_prefix,
    )
    return await bus.connect(s, role.user, wait=False)


@pytest.fixture
async def clients(secured_server: NatsServer, roles: dict[str, Role]) -> AsyncIterator[dict[str, NATS]]:
    out = {
        name: await _connect(secured_server, roles[name])
        for name in ("controlplane", "agent-gpu-a1", "router")
    }
    cp = out["controlplane"]
    await bus.ensure_all(cp.jetstream(), SUBJ)
    yield out
    for c in out.values():
        await c.close()


async def test_agent_publishes_its_own_heartbeat_only(clients: dict[str, NATS], denials: Denials) -> None:
    cp, agent = clients["controlplane"], clients["agent-gpu-a1"]
    own, other = SUBJ.heartbeat("gpu-a1"), SUBJ.heartbeat("gpu-a2")
    got: dict[str, list[bytes]] = {own: [], other: []}

    async def cb(m: Msg) -> None:
        got[m.subject].append(m.data)

    for subject in (own, other):
        await cp.subscribe(subject, cb=cb)
    await bus.flush(cp)

    async def publish(subject: str, seq: int) -> bytes:
        hb = encode(Heartbeat(node="gpu-a1", boot_id="b", seq=seq, sent_at=1.0))
        await agent.publish(subject, hb)
        await bus.flush(agent)
        return hb

    first = await publish(own, 1)
    await eventually(lambda: got[own] == [first], timeout=5, what="the agent's own heartbeat to arrive")
    await publish(other, 2)
    # A permission violation only reaches error_cb: once it did, the server has dropped the message.
    await denials.wait("agent-gpu-a1", other)
    # And a heartbeat the agent sends after it, on the same connection, arriving shows that one the
    # server had let through would have arrived by now.
    marker = await publish(own, 3)
    await eventually(
        lambda: got[own] == [first, marker], timeout=5, what="the agent's later heartbeat to arrive"
    )
    assert got[other] == []


@pytest.mark.slow
async def test_agent_reads_its_own_assignment_and_cannot_write_one(
    clients: dict[str, NATS], denials: Denials
) -> None:
    cp, agent = clients["controlplane"], clients["agent-gpu-a1"]
    cp_kv = await cp.jetstream().key_value(SUBJ.bucket_assign)
    mine = encode(Assignment(node="gpu-a1", fence=1))
    await cp_kv.put("gpu-a1", mine)
    await cp_kv.put("gpu-a2", encode(Assignment(node="gpu-a2", fence=1)))

    kv = await agent.jetstream(timeout=1.0).key_value(SUBJ.bucket_assign)
    entry = await kv.get("gpu-a1")
    assert entry.value == mine
    # Another node's key: the direct get is refused (not "not found": the key exists).
    with pytest.raises(nats.errors.TimeoutError):
        await kv.get("gpu-a2")
    await denials.wait(
        "agent-gpu-a1", f"$JS.API.DIRECT.GET.KV_{SUBJ.bucket_assign}.$KV.{SUBJ.bucket_assign}.gpu-a2"
    )
    # Its own key, written: refused by the server, so the write's ack never comes.
    with pytest.raises(nats.errors.TimeoutError):
        await kv.put("gpu-a1", encode(Assignment(node="gpu-a1", fence=99)))
    await denials.wait("agent-gpu-a1", f"$KV.{SUBJ.bucket_assign}.gpu-a1")
    # The control plane's value is untouched.
    after = await cp_kv.get("gpu-a1")
    assert (after.value, after.revision) == (mine, entry.revision)


@pytest.mark.slow
async def test_router_cannot_write_assignments_or_desired_state(
    clients: dict[str, NATS], denials: Denials
) -> None:
    cp, router = clients["controlplane"], clients["router"]
    cp_js = cp.jetstream()
    js = router.jetstream(timeout=1.0)
    for bucket in (SUBJ.bucket_assign, SUBJ.bucket_desired, SUBJ.bucket_keys):
        cp_kv = await cp_js.key_value(bucket)
        revision = await cp_kv.put("x", b"before")
        kv = await js.key_value(bucket)  # binding is allowed (stream info): the write is not
        with pytest.raises(nats.errors.TimeoutError):
            await kv.put("x", b"y")
        await denials.wait("router", f"$KV.{bucket}.x")
        after = await cp_kv.get("x")
        assert (after.value, after.revision) == (b"before", revision), bucket


async def test_router_can_read_routing(clients: dict[str, NATS]) -> None:
    cp, router = clients["controlplane"], clients["router"]
    await (await cp.jetstream().key_value(SUBJ.bucket_routing)).put("catalog", b"v1")
    kv = await router.jetstream(timeout=2.0).key_value(SUBJ.bucket_routing)
    assert (await kv.get("catalog")).value == b"v1"


async def test_a_router_hears_its_peers_usage_reports(
    secured_server: NatsServer, roles: dict[str, Role], clients: dict[str, NATS]
) -> None:
    """Quota shares across routers follow the peers' usage reports: under per-role credentials a router
    must be allowed to subscribe to them, or each one enforces a key's whole limit alone."""
    peer = await _connect(secured_server, roles["router"])
    try:
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def on(msg: Msg) -> None:
            await got.put(msg.data)

        await clients["router"].subscribe(f"{PREFIX}.router.*.usage", cb=on)
        await bus.flush(clients["router"])
        await peer.publish(f"{PREFIX}.router.r2.usage", b"report")
        await bus.flush(peer)
        assert await asyncio.wait_for(got.get(), 5.0) == b"report"
    finally:
        await peer.close()


@pytest.mark.slow
async def test_notifier_and_router_can_bind_every_bucket_but_write_none(
    secured_server: NatsServer, roles: dict[str, Role], clients: dict[str, NATS], denials: Denials
) -> None:
    cp_kv = await clients["controlplane"].jetstream().key_value(SUBJ.bucket_desired)
    revision = await cp_kv.put("settings", b"before")
    # What the server holds for this prefix is what Subjects declares (the test's list is not stale).
    streams = await clients["controlplane"].jetstream().streams_info()
    assert (
        sorted(
            s.config.name[3:]
            for s in streams
            if s.config.name is not None and s.config.name.startswith(f"KV_{PREFIX}_")
        )
        == EVERY_BUCKET
    )
    for name in ("notifier", "router"):
        nc = await _connect(secured_server, roles[name])
        try:
            js = nc.jetstream(timeout=2.0)
            buckets = await bus.ensure_all(js, SUBJ)  # binds: every bucket exists already
            assert sorted(buckets) == EVERY_BUCKET
            with pytest.raises(nats.errors.TimeoutError):
                await buckets[SUBJ.bucket_desired].put("settings", b"x")
            await denials.wait(name, f"$KV.{SUBJ.bucket_desired}.settings")
        finally:
            await nc.close()
    after = await cp_kv.get("settings")
    assert (after.value, after.revision) == (b"before", revision)


@pytest.mark.slow
async def test_an_agent_that_may_not_watch_still_follows_its_assignment(clients: dict[str, NATS]) -> None:
    """The agent role reads its key by direct get only; without a watch the follower polls often."""
    cp, agent = clients["controlplane"], clients["agent-gpu-a1"]
    cp_kv = await cp.jetstream().key_value(SUBJ.bucket_assign)
    await cp_kv.put("gpu-a1", encode(Assignment(node="gpu-a1", fence=1)))
    kv = await agent.jetstream(timeout=1.0).key_value(SUBJ.bucket_assign)
    seen: list[bytes | None] = []
    f = KvFollower(kv, lambda k, v, r: seen.append(v), key="gpu-a1", resync_s=60)
    await f.start()
    try:
        assert len(seen) == 1
        new = encode(Assignment(node="gpu-a1", fence=2))
        await cp_kv.put("gpu-a1", new)
        await eventually(
            lambda: new in seen,
            timeout=8,
            every=0.1,
            what="the follower to read the new assignment by polling",
        )
        assert not f.watching
    finally:
        await f.stop()


@pytest.mark.slow
async def test_a_router_writes_and_reads_the_usage_ledger_and_a_notifier_cannot_write_it(
    secured_server: NatsServer, roles: dict[str, Role], clients: dict[str, NATS], denials: Denials
) -> None:
    """The durable usage (usage_ledger): a router writes its hours and reads the month's at start
    (budgets that last across a restart); the notifier may not write one."""
    kv = await clients["router"].jetstream(timeout=2.0).key_value(SUBJ.bucket_usage)
    hour = UsageHour(router="r1", since=1.5, hour=3600.0, written_at=3700.0, usage={"k1": {"m": (1, 2, 3)}})
    rev = await kv.update(ledger_key(3600.0, "r1", 1.5), encode(hour), last=0)
    assert rev > 0
    assert await read_hours(kv) == [hour]
    nc = await _connect(secured_server, roles["notifier"])
    try:
        nkv = await nc.jetstream(timeout=2.0).key_value(SUBJ.bucket_usage)
        with pytest.raises(nats.errors.TimeoutError):
            await nkv.put(ledger_key(3600.0, "r9", 1.0), encode(hour))
        await denials.wait("notifier", f"$KV.{SUBJ.bucket_usage}.{ledger_key(3600.0, 'r9', 1.0)}")
    finally:
        await nc.close()


async def test_a_router_whose_watch_was_lost_reads_the_change_itself_under_its_role(
    clients: dict[str, NATS],
) -> None:
    """The follower's check (stream info) and catch-up (a get by sequence from the stream's leader) are
    within the router's permissions: a change its watch lost still reaches it (issue 35)."""
    cp, router = clients["controlplane"], clients["router"]
    cp_kv = await cp.jetstream().key_value(SUBJ.bucket_keys)
    await cp_kv.put("kw1", b"one")
    seen: dict[str, bytes | None] = {}
    f = KvFollower(
        await router.jetstream(timeout=2.0).key_value(SUBJ.bucket_keys),
        lambda k, v, r: seen.__setitem__(k, v),
        resync_s=0.2,
        name="router-keys",
    )
    await f.start()
    try:
        assert seen.get("kw1") == b"one"
        stream = f"KV_{SUBJ.bucket_keys}"
        for c in await cp.jetstream().consumers_info(stream):
            await cp.jetstream().delete_consumer(stream, c.name)
        reads = f.reads
        await cp_kv.put("kw1", b"two")
        await eventually(lambda: seen.get("kw1") == b"two", timeout=5, every=0.02, what="the change read")
        assert f.reads > reads
    finally:
        await f.stop()
