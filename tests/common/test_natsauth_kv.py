"""The KV-cache index's subjects and the tokenizers object store under per-role NATS users, on a real
nats-server: an agent publishes only its own node's deltas and answers only its own snapshot subject;
routers hear every node's deltas, ask any node, read tokenizers and cannot write them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.natsauth import Role, all_roles, authorization_config
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.security.test_nats_permissions import Denials, _connect

pytestmark = pytest.mark.slow
PREFIX = "llmgw"
SUBJ = Subjects(PREFIX)


@pytest.fixture
def denials(caplog: pytest.LogCaptureFixture) -> Denials:
    caplog.set_level(logging.WARNING, logger="llmgw.bus")
    return Denials(caplog)


@pytest.fixture(scope="module")
def roles() -> dict[str, Role]:
    return {r.user: r for r in all_roles(SUBJ, ["gpu-a1", "gpu-a2"])}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, roles: dict[str, Role]) -> Iterator[NatsServer]:
    d: Path = tmp_path_factory.mktemp("kvnats")
    conf = d / "auth.conf"
    conf.write_text(authorization_config(list(roles.values())))
    srv = NatsServer(d, config_file=str(conf))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
async def clients(secured: NatsServer, roles: dict[str, Role]) -> AsyncIterator[dict[str, NATS]]:
    out = {n: await _connect(secured, roles[n]) for n in ("agent-gpu-a1", "agent-gpu-a2", "router")}
    yield out
    for c in out.values():
        await c.close()


async def test_an_agent_publishes_its_own_kv_deltas_only(clients: dict[str, NATS], denials: Denials) -> None:
    a1, router = clients["agent-gpu-a1"], clients["router"]
    got: list[str] = []

    async def cb(m: Msg) -> None:
        got.append(m.subject)

    await router.subscribe(SUBJ.all_nodes("kv"), cb=cb)
    await bus.flush(router)
    await a1.publish(SUBJ.kv("gpu-a1"), b"mine")
    await eventually(
        lambda: got == [SUBJ.kv("gpu-a1")], timeout=5, what="a1's own deltas heard by the router"
    )
    # Another node's deltas, forged: the server refuses them, and the router never hears them.
    await a1.publish(SUBJ.kv("gpu-a2"), b"forged")
    await bus.flush(a1)
    await denials.wait("agent-gpu-a1", SUBJ.kv("gpu-a2"))
    await a1.publish(SUBJ.kv("gpu-a1"), b"marker")
    await eventually(lambda: len(got) == 2, timeout=5, what="a1's later deltas")
    assert got == [SUBJ.kv("gpu-a1")] * 2


async def test_a_router_asks_a_node_and_only_its_agent_hears(clients: dict[str, NATS]) -> None:
    a1, a2, router = clients["agent-gpu-a1"], clients["agent-gpu-a2"], clients["router"]
    heard: dict[str, list[bytes]] = {"a1": [], "a2": []}

    def answer(who: str) -> Callable[[Msg], Awaitable[None]]:
        async def cb(m: Msg) -> None:
            heard[who].append(m.data)
            await m.respond(b"page from " + who.encode())  # allow_responses: to the asker's inbox

        return cb

    await a1.subscribe(SUBJ.kv_snapshot("gpu-a1"), cb=answer("a1"))
    # Another node's agent may not listen there (it would answer for a1): the server refuses it.
    await a2.subscribe(SUBJ.kv_snapshot("gpu-a1"), cb=answer("a2"))
    await bus.flush(a1)
    with contextlib.suppress(nats.errors.Error):
        await bus.flush(a2)
    for _ in range(3):
        reply = await router.request(SUBJ.kv_snapshot("gpu-a1"), b"req", timeout=5)
        assert reply.data == b"page from a1"
    assert heard == {"a1": [b"req"] * 3, "a2": []}


async def test_agents_write_tokenizers_routers_read_them(clients: dict[str, NATS], denials: Denials) -> None:
    a1, router = clients["agent-gpu-a1"], clients["router"]
    store = await bus.ensure_object_store(a1.jetstream(timeout=2.0), SUBJ.bucket_tokenizers)
    await store.put("gemma", b"zip bytes")
    read = await bus.ensure_object_store(router.jetstream(timeout=2.0), SUBJ.bucket_tokenizers)
    assert (await read.get("gemma")).data == b"zip bytes"
    with pytest.raises(nats.errors.Error):
        await read.put("gemma", b"forged")
    chunks = f"$O.{SUBJ.bucket_tokenizers}.C.".lower()
    await eventually(
        lambda: any(d.startswith(chunks) for d in denials.of("router")),
        timeout=5,
        what="the router's put refused",
    )
    assert (await read.get("gemma")).data == b"zip bytes"
