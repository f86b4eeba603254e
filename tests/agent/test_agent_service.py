"""The agent end to end with a real nats-server and real simulated engines.

assignment written → engine starts → heartbeat shows ready → load reported → garbage survived →
assignment deleted → engine stopped; and an agent killed with SIGKILL re-adopts its engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import psutil
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_agent.service import serve
from llmgw_common import bus
from llmgw_common.bus import ensure_kv
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import (
    Assignment,
    Heartbeat,
    Inventory,
    LoadReport,
    ShardAssignment,
    ShardState,
    ShardStatus,
)
from llmgw_common.natsserver import NatsServer
from llmgw_common.settings import AgentSettings
from llmgw_common.subjects import Subjects
from tests.agent.agent_helpers import alive, free_port, kill_group
from tests.kit.poll import eventually

pytestmark = pytest.mark.e2e
KINDS: dict[str, type[Any]] = {
    "heartbeat": Heartbeat,
    "inventory": Inventory,
    "status": ShardStatus,
    "load": LoadReport,
}


@dataclass
class Seen:
    """Everything a node published, decoded, with a way to wait for a condition on it."""

    msgs: dict[str, list[Any]] = field(default_factory=lambda: {k: [] for k in KINDS})
    bad: list[str] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_msg(self, msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        try:
            self.msgs[kind].append(decode(msg.data, KINDS[kind]))
        except (DecodeError, KeyError):
            self.bad.append(msg.subject)
        self.changed.set()

    def mark(self, kind: str) -> int:
        return len(self.msgs[kind])

    async def wait(
        self, kind: str, pred: Callable[[Any], bool], timeout: float = 20.0, since: int = 0
    ) -> Any:
        """The first message of ``kind`` from index ``since`` on that satisfies ``pred``."""

        async def find() -> Any:
            while True:
                for m in self.msgs[kind][since:]:
                    if pred(m):
                        return m
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(find(), timeout)


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


async def watch_node(nc: NATS, prefix: str, node: str) -> Seen:
    seen = Seen()
    await nc.subscribe(f"{prefix}.node.{node}.*", cb=seen.on_msg)
    return seen


def shard_of(hb: Heartbeat, replica: str) -> Any:
    return next((s for s in hb.shards if s.replica_id == replica), None)


async def test_assign_ready_load_garbage_delete(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    node = "n1"
    s = AgentSettings(
        node=node,
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path / "agent"),
        simulate_engines=True,
        sim_gpus="2xL4-24GB",
        heartbeat_interval_s=0.3,
        load_interval_s=0.2,
        stop_grace_s=2.0,
    )
    subjects = Subjects(prefix)
    seen = await watch_node(nc, prefix, node)
    kv = await ensure_kv(nc.jetstream(), subjects.bucket_assign)
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(s, stop))
    pids: list[int] = []
    try:
        inv = await seen.wait("inventory", lambda m: True)
        assert inv.node == node and len(inv.gpus) == 2
        p_vllm, p_llama = free_port(), free_port()
        assignment = Assignment(
            node=node,
            fence=1,
            shards=(
                ShardAssignment(
                    replica_id="rv",
                    shard=0,
                    model="mv",
                    engine="vllm",
                    gpus=(0,),
                    port=p_vllm,
                    options={"ttft_ms": 1},
                ),
                ShardAssignment(replica_id="rl", shard=0, model="ml", engine="llamacpp", port=p_llama),
                # vLLM without a GPU: refused, with the reason, not started.
                ShardAssignment(replica_id="rx", shard=0, model="mx", engine="vllm", port=free_port()),
            ),
        )
        await kv.put(node, encode(assignment))

        hb = await seen.wait(
            "heartbeat",
            lambda h: all(
                (x := shard_of(h, r)) is not None and x.state is ShardState.READY for r in ("rv", "rl")
            ),
        )
        pids = [shard_of(hb, r).pid for r in ("rv", "rl")]
        assert all(p and alive(p) for p in pids)
        assert shard_of(hb, "rx").state is ShardState.FAILED
        refused = await seen.wait("status", lambda m: m.replica_id == "rx")
        assert refused.state is ShardState.FAILED and "vLLM needs a GPU" in (refused.error or "")
        starting = [m.state for m in seen.msgs["status"] if m.replica_id == "rv"]
        assert starting[:2] == [ShardState.STARTING, ShardState.READY]

        load = await seen.wait("load", lambda m: {r.replica_id for r in m.replicas} == {"rv", "rl"})
        by = {r.replica_id: r for r in load.replicas}
        assert by["rv"].running == 0.0 and by["rv"].waiting == 0.0 and by["rv"].kv_use is not None
        # llama.cpp style: running and waiting known, KV use blank (not 0).
        assert by["rl"].running == 0.0 and by["rl"].waiting == 0.0 and by["rl"].kv_use is None

        # A malformed assignment: one log line, engines untouched.
        caplog.clear()
        await kv.put(node, b"\x93garbage")
        # Garbage on the node's own subjects and on the ctl prefix: nothing the agent reads breaks.
        for kind in KINDS:
            await nc.publish(subjects.__getattribute__(kind)(node), b"\xc1\xc1not msgpack")
        await nc.flush()
        n_hb = seen.mark("heartbeat")
        await seen.wait("heartbeat", lambda h: seen.mark("heartbeat") >= n_hb + 3, since=n_hb)
        drops = [r for r in caplog.records if "dropped undecodable" in r.getMessage()]
        assert len(drops) == 1, [r.getMessage() for r in drops]
        assert f"{subjects.bucket_assign}/{node}" in drops[0].getMessage()
        assert all(alive(p) for p in pids)
        hb = seen.msgs["heartbeat"][-1]
        assert shard_of(hb, "rv").state is ShardState.READY and shard_of(hb, "rv").pid == pids[0]

        # Delete: every engine stopped.
        mark = seen.mark("heartbeat")
        await kv.delete(node)
        await seen.wait("heartbeat", lambda h: h.shards == (), since=mark)
        for r in ("rv", "rl", "rx"):

            def stopped(m: ShardStatus, r: str = r) -> bool:
                return m.replica_id == r and m.state is ShardState.STOPPED

            await seen.wait("status", stopped)
        assert not any(alive(p) for p in pids)
        assert not agent.done()
    finally:
        stop.set()
        await asyncio.wait_for(agent, 20)
        for p in pids:
            kill_group(p)
    # The last heartbeat after stop shows nothing running; seq only grew.
    seqs = [h.seq for h in seen.msgs["heartbeat"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


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
        first.wait(10)
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
        assert second.wait(20) == 0
        assert not any(alive(p) for p in pids)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(5)
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


def fake_collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
    return Inventory(node=s.node, boot_id=boot_id, sent_at=now)


async def test_load_report_reads_the_engine_and_blanks_what_it_cannot_scrape(
    nc: NATS, tmp_path: Path, engine_script: Path, reap_groups: list[int]
) -> None:
    from llmgw_agent.service import Agent
    from llmgw_agent.supervisor import Shard
    from llmgw_common.messages import ReplicaLoad
    from tests.agent.agent_helpers import assignment, script_spec

    agent = Agent(AgentSettings(node="n6", state_dir=str(tmp_path)), nc, collect=fake_collect)
    try:
        port = free_port()
        await agent.supervisor.start(assignment(port, replica="live"), script_spec(engine_script, port))
        live = agent.supervisor.shards["live", 0]
        reap_groups.append(live.pgid or 0)
        dead_port = free_port()
        dead = Shard(
            assignment=assignment(dead_port, replica="dead"),
            spec=script_spec(engine_script, dead_port),
            log_path=tmp_path / "dead.log",
            state=ShardState.READY,
        )
        agent.supervisor.shards[dead.key] = dead
        await eventually(
            lambda: live.state is ShardState.READY, timeout=15, what="the live shard to be ready"
        )
        report = await agent.load_report()
        by = {r.replica_id: r for r in report.replicas}
        # The script's /metrics: vLLM names for running and waiting, no KV metric at all.
        assert by["live"] == ReplicaLoad(replica_id="live", shard=0, running=2.0, waiting=1.0, kv_use=None)
        # Nothing answers: every figure blank, not 0.
        assert by["dead"] == ReplicaLoad(replica_id="dead", shard=0)
        assert report.node == "n6"
    finally:
        agent.supervisor.shards.pop(("dead", 0), None)
        await agent.supervisor.stop_all()
        await agent.supervisor.aclose()


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


async def test_multi_node_sim_replica_leader_ready_only_with_its_follower(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    """Two agents, one replica over both nodes: the leader turns ready once the follower has joined."""
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    leader_port, follower_port = free_port(), free_port()
    common = dict(replica_id="mn", shards=2, model="big", engine="sim", leader=f"127.0.0.1:{leader_port}")
    lead = ShardAssignment(shard=0, port=leader_port, startup_timeout_s=30, **common)  # type: ignore[arg-type]
    follow = ShardAssignment(shard=1, port=follower_port, **common)  # type: ignore[arg-type]
    seen_a, seen_b = await watch_node(nc, prefix, "na"), await watch_node(nc, prefix, "nb")

    def settings(node: str) -> AgentSettings:
        return AgentSettings(
            node=node,
            nats_urls=[nats_server.url],
            prefix=prefix,
            state_dir=str(tmp_path / node),
            heartbeat_interval_s=0.3,
            load_interval_s=0.3,
            stop_grace_s=2.0,
        )

    stop = asyncio.Event()
    agents = [asyncio.create_task(serve(settings(n), stop, collect=fake_collect)) for n in ("na", "nb")]
    pids: list[int] = []
    try:
        await kv.put("na", encode(Assignment(node="na", shards=(lead,))))
        # Alone, the leader starts but is not ready: its follower has not joined.
        hb = await seen_a.wait("heartbeat", lambda h: (x := shard_of(h, "mn")) is not None and x.pid)
        pids.append(shard_of(hb, "mn").pid)
        mark = seen_a.mark("heartbeat")
        await seen_a.wait("heartbeat", lambda h: seen_a.mark("heartbeat") >= mark + 4, since=mark)
        assert shard_of(seen_a.msgs["heartbeat"][-1], "mn").state is ShardState.STARTING
        await kv.put("nb", encode(Assignment(node="nb", shards=(follow,))))
        hb_b = await seen_b.wait(
            "heartbeat", lambda h: (x := shard_of(h, "mn")) is not None and x.state == "ready"
        )
        pids.append(shard_of(hb_b, "mn").pid)
        await seen_a.wait("heartbeat", lambda h: (x := shard_of(h, "mn")) is not None and x.state == "ready")
        # Load comes from the leader only (a follower has no /metrics).
        load_a = await seen_a.wait("load", lambda m: len(m.replicas) == 1)
        assert load_a.replicas[0].running == 0.0
        load_b = seen_b.msgs["load"][-1]
        assert load_b.replicas == ()
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents), 20)
        for p in pids:
            kill_group(p)
    assert not any(alive(p) for p in pids)


async def test_inventory_sent_on_change_and_on_interval_only(nc: NATS, prefix: str, tmp_path: Path) -> None:
    from llmgw_agent.service import INVENTORY_CHECK_S, Agent

    labels = {"role": "a"}

    def collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
        return Inventory(node=s.node, boot_id=boot_id, sent_at=now, labels=dict(labels))

    s = AgentSettings(node="n8", prefix=prefix, state_dir=str(tmp_path), inventory_interval_s=60)
    sent: list[Inventory] = []

    async def on(msg: Msg) -> None:
        sent.append(decode(msg.data, Inventory))

    await nc.subscribe(Subjects(prefix).inventory("n8"), cb=on)
    agent = Agent(s, nc, collect=collect)
    try:
        for now, change in [(1000.0, None), (1001.0, "b"), (1000 + INVENTORY_CHECK_S, None), (1025.0, None)]:
            if change:
                labels["role"] = change  # changed, but not looked at before the next check
            await agent._inventory_if_due(now)
        await agent._inventory_if_due(1071.0)  # unchanged, but 60 s since the last one: sent again
        await nc.flush()
        await eventually(lambda: len(sent) >= 3, timeout=5, what="three inventories on the bus")
        assert [(m.sent_at, m.labels["role"]) for m in sent] == [
            (1000.0, "a"),
            (1000 + INVENTORY_CHECK_S, "b"),
            (1071.0, "b"),
        ]
    finally:
        await agent.supervisor.aclose()


async def test_inventory_is_sent_again_when_the_control_plane_asks(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    s = AgentSettings(
        node="n9",
        prefix=prefix,
        nats_urls=[nats_server.url],
        state_dir=str(tmp_path),
        inventory_interval_s=600,
        load_interval_s=0.05,
    )
    sent: list[Inventory] = []
    loads = 0

    async def on(msg: Msg) -> None:
        sent.append(decode(msg.data, Inventory))

    async def on_load(_msg: Msg) -> None:
        nonlocal loads
        loads += 1

    subj = Subjects(prefix)
    await nc.subscribe(subj.inventory("n9"), cb=on)
    await nc.subscribe(subj.load("n9"), cb=on_load)
    await bus.sent(nc)
    # The agent's clock, moved by the test: the interval is judged on it, not on how long we wait.
    now = [1_000_000.0]
    stop = asyncio.Event()
    agent = asyncio.create_task(
        serve(
            s,
            stop,
            collect=lambda s, b, t: Inventory(node=s.node, boot_id=b, sent_at=t),
            clock=lambda: now[0],
        )
    )
    try:

        async def ticks_pass() -> None:
            # Each tick sends its load report before it judges the inventory: two more reports mean
            # a whole tick judged it on the clock as it is now.
            seen = loads
            await eventually(lambda: loads >= seen + 2, every=0.01, what="two more load reports (ticks)")

        await eventually(lambda: len(sent) >= 1, every=0.01, what="the first inventory")
        now[0] += 599.0  # unchanged, and not yet due
        await ticks_pass()
        assert len(sent) == 1
        await nc.publish(subj.inventory_request("n9"), b"")
        await eventually(lambda: len(sent) >= 2, every=0.01, what="an inventory sent on request")
        now[0] += 600.0  # due again: the interval is kept without being asked
        await eventually(lambda: len(sent) >= 3, every=0.01, what="an inventory sent after the interval")
    finally:
        stop.set()
        await agent
