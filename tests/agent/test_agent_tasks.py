"""An agent whose assignment watch dies must not run on deaf: it ends (exit 70 from run_service).

Before, only the tick and converge loops were watched: a KvFollower loop that ended left the agent
heartbeating while it would never again hear a new assignment, and a loop that returned without an
error let the agent exit 0.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from llmgw_agent.service import Agent
from llmgw_agent.settings import AgentSettings
from llmgw_common.messages import Inventory
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.runtime import TaskDied, cancel_and_wait
from tests.kit.cancels import swallows_one_cancel
from tests.kit.poll import eventually


def _collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
    return Inventory(node=s.node, boot_id=boot_id, sent_at=now)


@pytest.mark.parametrize("which", ["assign-watch", "assign-resync", "agent-tick"])
@pytest.mark.slow
async def test_a_loop_that_ends_ends_the_run(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path, which: str
) -> None:
    s = AgentSettings(
        node="n1",
        nats_urls=[nats_server.url],
        prefix=prefix,
        state_dir=str(tmp_path),
        heartbeat_interval_s=0.2,
        load_interval_s=0.2,
    )
    agent = Agent(s, nc, collect=_collect)
    stop = asyncio.Event()
    run = asyncio.create_task(agent.run(stop))
    try:

        def loops() -> list[asyncio.Task[object]]:
            """The agent's loops and its assignment follower's, once both have started them."""
            if agent.follower is None or not agent.follower.tasks or not agent.tasks:
                return []
            return [*agent.tasks, *agent.follower.tasks]

        running = await eventually(loops, timeout=10, what="the agent and its follower to start their loops")
        names = sorted(t.get_name() for t in running)
        victim = next((t for t in running if t.get_name() == which), None)
        assert victim is not None, names
        # Not one cancel: the loop's nats request or flush can swallow it (see cancel_and_wait).
        await cancel_and_wait([victim])
        with pytest.raises(TaskDied) as died:
            await asyncio.wait_for(run, 10)
        assert died.value.task_name == which
    finally:
        stop.set()
        if not run.done():
            run.cancel()
        await asyncio.gather(run, return_exceptions=True)


@pytest.mark.slow
async def test_stop_ends_a_loop_that_swallowed_a_cancel(
    nats_server: NatsServer, nc: NATS, prefix: str, tmp_path: Path
) -> None:
    """Python 3.11's asyncio.wait_for (in nats-py's request and flush, and in the converge loop's wait)
    drops a cancel that lands as its answer arrives (CPython gh-86296). A stop that cancelled the
    agent's loops once then waited for them for ever: `llmgw up` killed the agent after its grace
    period, its engines left to the sweep."""
    s = AgentSettings(node="n1", nats_urls=[nats_server.url], prefix=prefix, state_dir=str(tmp_path))
    agent = Agent(s, nc, collect=_collect)
    stop = asyncio.Event()
    run = asyncio.create_task(agent.run(stop))

    stubborn = asyncio.create_task(swallows_one_cancel())
    try:

        async def loops() -> None:
            while not agent.tasks:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(loops(), 10)
        agent.tasks.append(stubborn)
        await asyncio.sleep(0)
        stop.set()
        # Not wait_for: it would cancel run(), and a second cancel is what the fix does.
        done, _ = await asyncio.wait({run}, timeout=10)
        assert run in done and stubborn.done()
    finally:
        # Not one cancel each: the stand-in drops its first, and a failed check would then hang.
        await cancel_and_wait([run, stubborn], again_s=0.05)
