"""ctl answers larger than one NATS message: a real control plane on a nats-server whose max_payload is
32 KiB, a few hundred synthetic nodes (the bench's generator), and the real CLI. The same happens at
5,000 nodes with the default 1 MiB limit (see the helper's report for the figure)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common import chunks
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.ctl import Empty, NodeInfo, NodesReply
from llmgw_common.subjects import Subjects
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_runtime.bus import flush
from llmgw_runtime.ctl_client import CtlClient, CtlError
from llmgw_runtime.natsserver import NatsServer
from llmgw_sim.synthetic import synthetic_inventories
from tests.controlplane.cp_helpers import cp_settings, ctl_answers, start_cp
from tests.kit.poll import eventually

MAX_PAYLOAD = 32 * 1024
NODES = 300

CATALOG = f"""
models:
  - name: m
    engine: sim
    gpu_class: H100-80GB
    replicas: {NODES}
"""


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path_factory.mktemp("nats-small"), max_payload=MAX_PAYLOAD)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
async def small_nc(small_nats: NatsServer) -> AsyncIterator[NATS]:
    nc = await nats.connect(small_nats.url)
    yield nc
    await nc.close()


async def _cli(url: str, prefix: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw_cli", "ctl", *args, "--nats", url, "--prefix", prefix, "--timeout", "20",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await p.communicate()
    assert p.returncode == 0, f"ctl {' '.join(args)} exited {p.returncode}: {err.decode()[-2000:]}"
    return out.decode()


@pytest.mark.slow
async def test_ctl_answers_beyond_max_payload_whole(
    small_nats: NatsServer, small_nc: NATS, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert small_nc.max_payload == MAX_PAYLOAD
    # The lease at its default TTL, not the helpers' 1.5 s (made for quick takeovers): ingesting 300
    # inventories and placing 300 replicas holds this one event loop for 0.3 s at a stretch, over 1 s on a
    # loaded 2-core box, and 1.5 s lapsed under that; a lone control plane then stepped down (its ctl gone).
    s = cp_settings(
        small_nats.url,
        prefix,
        heartbeat_interval_s=5.0,
        unreachable_after_missed=6,
        node_lost_s=300.0,
        lease_ttl_s=ControlPlaneSettings.model_fields["lease_ttl_s"].default,
    )
    run = await start_cp(s, catalog_text=CATALOG)
    subj = Subjects(prefix)
    try:
        for inv in synthetic_inventories(NODES):
            await small_nc.publish(subj.inventory(inv.node), encode(inv))
        await flush(small_nc)

        def placed() -> bool:
            st = run.cp.state
            return run.cp.leader and len(st.nodes) == NODES and len(st.replicas) == NODES

        await eventually(placed, timeout=60, what=f"{NODES} nodes known and {NODES} replicas placed")
        await ctl_answers(small_nc, prefix)  # placing can run while its ctl endpoints are being registered
        ctl = CtlClient(small_nc, prefix, timeout=20)
        reply = await ctl.nodes()
        assert len(reply.nodes) == NODES
        assert len(encode(reply)) > 3 * MAX_PAYLOAD  # several messages' worth
        assert len((await ctl.replicas()).replicas) == NODES
        assert (await ctl.status()).simulated_nodes == NODES

        nodes_json, replicas_json, table = await asyncio.gather(
            _cli(small_nats.url, prefix, "nodes", "-o", "json"),
            _cli(small_nats.url, prefix, "replicas", "-o", "json"),
            _cli(small_nats.url, prefix, "nodes"),
        )
        got = NodesReply.model_validate(json.loads(nodes_json))
        assert [n.name for n in got.nodes] == sorted(inv.node for inv in synthetic_inventories(NODES))
        assert len(json.loads(replicas_json)["replicas"]) == NODES
        assert sum(1 for ln in table.splitlines() if ln.startswith("node-")) == NODES
    finally:
        await run.stop()
    # A lone control plane keeps its own lease through its own work (at its real TTL).
    assert not [m for m in caplog.messages if "no longer leading" in m or "leadership lost" in m]


# ---------------------------------------------------------------- the protocol's edges


def test_split_fits_each_part_and_joins_back() -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes
    limit = 4096 + chunks.HEADROOM
    parts = chunks.split(data, limit)
    assert [len(p) for p in parts] == [4096, 4096, 2048] and b"".join(parts) == data
    assert chunks.split(data[:4096], limit) == [data[:4096]]  # exactly one message's worth: one part
    with pytest.raises(ValueError, match="leaves no room"):
        chunks.split(data, chunks.HEADROOM)
    with pytest.raises(ValueError, match=f"needs {chunks.MAX_CHUNKS + 1} chunks"):
        chunks.split(b"x" * (chunks.MAX_CHUNKS + 1), chunks.HEADROOM + 1)


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        ([("2/2", b"b"), ("1/2", b"a")], "chunk '2/2' arrived where 1/n was due"),
        ([("1/2", b"a"), ("1/2", b"a")], "chunk '1/2' arrived where 2/2 was due"),
        ([("1/2", b"a"), ("2/3", b"b")], "chunk '2/3' arrived where 2/2 was due"),
        ([("1/x", b"a")], "unreadable chunk header '1/x'"),
        ([("1/2", b"a")], "stopped after 1 of 2 parts"),
    ],
)
@pytest.mark.slow
async def test_client_refuses_a_broken_chunk_sequence(
    bus_nc: NATS, prefix: str, sent: list[tuple[str, bytes]], why: str
) -> None:
    """A responder on the real bus sending parts out of order, twice, or not all: an error, never data."""

    async def responder(msg: Msg) -> None:
        for value, part in sent:
            await bus_nc.publish(msg.reply, part, headers={chunks.CHUNK_HEADER: value})

    sub = await bus_nc.subscribe(Subjects(prefix).ctl("nodes"), cb=responder)
    await flush(bus_nc)
    try:
        with pytest.raises(CtlError, match=re.escape(why)):
            await CtlClient(bus_nc, prefix, timeout=0.5).nodes()
    finally:
        await sub.unsubscribe()


async def test_a_client_that_cannot_join_parts_gets_an_error_not_a_short_answer(
    bus_nc: NATS, prefix: str
) -> None:
    """What a client from before chunking sees (nc.request() keeps the first part): undecodable."""
    big = encode(NodesReply(nodes=tuple(NodeInfo(name=f"n{i:04d}", state="ready") for i in range(500))))
    parts = chunks.split(big, 4096 + chunks.HEADROOM)
    assert len(parts) > 2

    async def responder(msg: Msg) -> None:
        for i, part in enumerate(parts, 1):
            await bus_nc.publish(msg.reply, part, headers=chunks.header(i, len(parts)))

    sub = await bus_nc.subscribe(Subjects(prefix).ctl("nodes"), cb=responder)
    await flush(bus_nc)
    try:
        first = await bus_nc.request(Subjects(prefix).ctl("nodes"), encode(Empty()), timeout=2)
        with pytest.raises(DecodeError):
            decode(first.data, NodesReply)
        # The current client joins them.
        assert len((await CtlClient(bus_nc, prefix, timeout=2).nodes()).nodes) == 500
    finally:
        await sub.unsubscribe()
