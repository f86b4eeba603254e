"""The agent serving its assignment, end to end with a real nats-server and real simulated engines.

assignment written → engine starts → heartbeat shows ready → load reported → garbage survived →
assignment deleted → engine stopped; a replica over two nodes; the load report's figures.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.service import serve
from llmgw_agent.settings import AgentSettings
from llmgw_common.codec import encode
from llmgw_common.messages import Assignment, ShardAssignment, ShardState, ShardStatus
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer
from tests.agent.agent_helpers import KINDS, alive, fake_collect, free_port, kill_group, shard_of, watch_node
from tests.kit.poll import eventually

pytestmark = pytest.mark.e2e


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

        # The first report may name a replica not yet scraped (running unknown, None, never 0: a loaded
        # box showed one): the first that has both engines' figures.
        load = await seen.wait(
            "load", lambda m: {r.replica_id for r in m.replicas if r.running is not None} == {"rv", "rl"}
        )
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
        await bus.flush(nc)
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


async def test_multi_node_sim_replica_leader_ready_only_with_its_follower(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    """Two agents, one replica over both nodes: the leader turns ready once the follower has joined."""
    kv = await ensure_kv(nc.jetstream(), Subjects(prefix).bucket_assign)
    leader_port, follower_port = free_port(), free_port()
    common = dict(replica_id="mn", shards=2, model="big", engine="sim", leader=f"127.0.0.1:{leader_port}")
    lead = ShardAssignment(shard=0, port=leader_port, startup_timeout_s=30, **common)
    follow = ShardAssignment(shard=1, port=follower_port, **common)
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
        # The follower's agent has no line to send (a node without one sends no load report at all).
        assert [m.replicas for m in seen_b.msgs.get("load", []) if m.replicas] == []
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents), 20)
        for p in pids:
            kill_group(p)
    assert not any(alive(p) for p in pids)


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
