"""The agent's life with a real nats-server and real simulated engines: a stop stops its engines, an
agent killed with SIGKILL re-adopts them, NATS unreachable or restarted, a loop that dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import psutil
import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_common.codec import encode
from llmgw_common.messages import Assignment, Heartbeat, Inventory, ShardAssignment, ShardState
from llmgw_common.subjects import Subjects
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import alive, fake_collect, free_port, kill_group, shard_of, watch_node
from tests.kit.poll import eventually

pytestmark = pytest.mark.e2e


async def test_stop_stops_engines_then_returns(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    node = "n3"
    s = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        heartbeat_interval_s=0.3,
        load_interval_s=0.3,
        stop_grace_s=2.0,
    )
    seen = await watch_node(nc, prefix, node)
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    await kv.put(
        node,
        encode(
            Assignment(
                node=node,
                shards=(ShardAssignment(replica_id="r", shard=0, model="m", engine="sim", port=free_port()),),
            )
        ),
    )
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(s, stop))
    pid = None
    try:
        hb = await seen.wait(
            "heartbeat", lambda h: (x := shard_of(h, "r")) is not None and x.state == "ready"
        )
        pid = shard_of(hb, "r").pid
        # A stale leader's write (lower fence) is ignored.
        await kv.put(node, encode(Assignment(node=node, fence=-1)))
        n_hb = seen.mark("heartbeat")
        await seen.wait("heartbeat", lambda h: seen.mark("heartbeat") >= n_hb + 2, since=n_hb)
        assert shard_of(seen.msgs["heartbeat"][-1], "r") is not None
    finally:
        stop.set()
        await asyncio.wait_for(agent, 20)
        if pid:
            kill_group(pid)
    assert pid is not None and not alive(pid)


def start_agent(url: str, prefix: str, node: str, state_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "LLMGW_HEARTBEAT_INTERVAL_S": "0.3",
        "LLMGW_LOAD_INTERVAL_S": "0.3",
        "LLMGW_STOP_GRACE_S": "2",
    }
    argv = [sys.executable, "-m", "llmgw_cli", "agent", "--nats", url, "--prefix", prefix, "--node", node]
    argv += ["--state-dir", str(state_dir), "--simulate-engines", "--sim-gpus", "1xL4-24GB"]
    with log.open("ab") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


async def test_sigkilled_agent_readopts_its_engines(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    node = "n2"
    seen = await watch_node(nc, prefix, node)
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    shards = tuple(
        ShardAssignment(replica_id=f"r{i}", shard=0, model="m", engine="vllm", gpus=(0,), port=free_port())
        for i in range(2)
    )
    await kv.put(node, encode(Assignment(node=node, shards=shards)))
    log = tmp_path / "agent.log"
    first = start_agent(nats_server.url, prefix, node, tmp_path / "state", log)
    second: subprocess.Popen[bytes] | None = None
    pids: list[int] = []

    def all_ready(h: Heartbeat) -> bool:
        return len(h.shards) == 2 and all(x.state is ShardState.READY for x in h.shards)

    try:
        hb1 = await seen.wait("heartbeat", all_ready, timeout=30)
        pids = [x.pid for x in hb1.shards]
        created = [psutil.Process(p).create_time() for p in pids]
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)
        assert all(alive(p) for p in pids)

        second = start_agent(nats_server.url, prefix, node, tmp_path / "state", log)
        # The very first heartbeat of the new boot says the engines are ready, as they were: one that
        # said "starting" (or nothing) would take their endpoints from the routers until a later one.
        hb2 = await seen.wait(
            "heartbeat", lambda h: h.boot_id != hb1.boot_id, timeout=30, since=seen.mark("heartbeat")
        )
        assert all_ready(hb2), hb2
        assert [x.pid for x in hb2.shards] == pids
        assert [psutil.Process(p).create_time() for p in pids] == created
        # Re-adopted, not restarted, and never reported starting again.
        new_status = [m for m in seen.msgs["status"] if m.boot_id == hb2.boot_id]
        assert {m.state for m in new_status} == {ShardState.READY}, new_status

        # A clean stop of the new agent stops the adopted engines too.
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 20) == 0
        assert not any(alive(p) for p in pids)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                await asyncio.to_thread(proc.wait, 5)
        for p in pids:
            kill_group(p)
        with contextlib.suppress(OSError):
            print(log.read_text()[-4000:])


async def test_stop_while_nats_is_unreachable_returns(tmp_path: Path) -> None:
    # Not a NATS server: it takes each connection and hangs up, so every attempt fails and is counted.
    attempts = 0

    async def hang_up(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal attempts
        attempts += 1
        w.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    s = AgentSettings(node="n4", nats_urls=[f"nats://127.0.0.1:{port}"], state_dir=str(tmp_path))
    stop = asyncio.Event()
    agent = asyncio.create_task(
        serve(s, stop, collect=lambda s, b, now: Inventory(node=s.node, boot_id=b, sent_at=now))
    )
    try:
        # A second attempt is the sign that the first failure did not end the agent: it is retrying.
        def retrying() -> bool:
            assert not agent.done(), agent
            return attempts >= 2

        await eventually(retrying, timeout=10, what="a second connection attempt")
        assert not agent.done()
        stop.set()
        await asyncio.wait_for(agent, 10)
    finally:
        server.close()
        await server.wait_closed()


async def test_bad_node_id_is_refused(tmp_path: Path) -> None:
    s = AgentSettings(node="bad.node", state_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"node id 'bad\.node'"):
        await serve(s, asyncio.Event())


async def test_a_loop_that_dies_stops_the_agent_and_its_engines(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    node = "n5"
    calls = 0
    ready = asyncio.Event()
    seen = await watch_node(nc, prefix, node)

    def collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
        nonlocal calls
        calls += 1
        if ready.is_set():
            raise RuntimeError("inventory bug")
        return Inventory(node=s.node, boot_id=boot_id, sent_at=now)

    s = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path),
        heartbeat_interval_s=0.3,
        load_interval_s=0.3,
        inventory_interval_s=0.3,
        stop_grace_s=2.0,
    )
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    a = ShardAssignment(replica_id="r", shard=0, model="m", engine="sim", port=free_port())
    await kv.put(node, encode(Assignment(node=node, shards=(a,))))
    agent = asyncio.create_task(serve(s, asyncio.Event(), collect=collect))
    pid = None
    try:
        hb = await seen.wait(
            "heartbeat", lambda h: (x := shard_of(h, "r")) is not None and x.state == "ready"
        )
        pid = shard_of(hb, "r").pid
        ready.set()
        with pytest.raises(RuntimeError, match="inventory bug"):
            await asyncio.wait_for(agent, 20)
        assert pid is not None and not alive(pid)
    finally:
        if not agent.done():
            agent.cancel()
        if pid:
            kill_group(pid)


async def test_nats_restart_resends_inventory_and_keeps_engines(tmp_path: Path, prefix: str) -> None:
    port = free_port()
    srv = NatsServer(tmp_path / "nats", port=port)
    await asyncio.to_thread(srv.start)
    node = "n7"
    s = AgentSettings(
        node=node,
        nats_urls=[srv.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        heartbeat_interval_s=0.3,
        load_interval_s=0.3,
        stop_grace_s=2.0,
    )

    async def quiet(e: Exception) -> None:  # the restart makes the test's own client complain
        return None

    watcher = await nats.connect(srv.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1, error_cb=quiet)
    seen = await watch_node(watcher, prefix, node)
    kv = await ensure_kv(watcher.jetstream(), Subjects(prefix).bucket_assign)
    a = ShardAssignment(replica_id="r", shard=0, model="m", engine="sim", port=free_port())
    await kv.put(node, encode(Assignment(node=node, shards=(a,))))
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(s, stop, collect=fake_collect))
    pid = None
    try:
        hb = await seen.wait(
            "heartbeat", lambda h: (x := shard_of(h, "r")) is not None and x.state == "ready"
        )
        pid = shard_of(hb, "r").pid
        n_inv = seen.mark("inventory")
        await asyncio.to_thread(srv.stop)
        # A fresh object on the same port and store: NatsServer.start() on a stopped instance keeps
        # the old monitor port and never sees the new server healthy.
        srv = NatsServer(tmp_path / "nats", port=port)
        await asyncio.to_thread(srv.start)
        # Reconnected: the inventory is sent again at once (not after inventory_interval_s = 60 s).
        inv = await seen.wait("inventory", lambda m: True, since=n_inv, timeout=20)
        assert inv.boot_id == hb.boot_id
        hb2 = await seen.wait("heartbeat", lambda h: h.seq > hb.seq + 1, since=seen.mark("heartbeat"))
        assert shard_of(hb2, "r").pid == pid and alive(pid)
    finally:
        stop.set()
        await asyncio.wait_for(agent, 20)
        await watcher.close()
        await asyncio.to_thread(srv.stop)
        if pid:
            kill_group(pid)
