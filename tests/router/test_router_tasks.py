"""The router's loops: a failing tick is counted and the ticks go on; a loop that ends ends the router."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import decode
from llmgw_common.router_messages import IdleReport
from llmgw_common.subjects import Subjects
from llmgw_router.service import Router
from llmgw_router.settings import RouterSettings
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.runtime import TaskDied, cancel_and_wait
from tests.kit.poll import eventually


async def _bus_router(url: str, prefix: str) -> Router:
    r = Router(RouterSettings(port=0, nats_urls=[url], prefix=prefix, router_id="rt", tick_s=0.05))
    await r.start()
    await asyncio.wait_for(r.synced.wait(), 10)
    return r


async def test_a_failing_tick_is_counted_and_the_ticks_go_on(
    nats_server: NatsServer, prefix: str, nc: NATS
) -> None:
    reports: list[IdleReport] = []

    async def on_idle(msg: Msg) -> None:
        reports.append(decode(msg.data, IdleReport))

    await nc.subscribe(Subjects(prefix).idle("rt"), cb=on_idle)
    await bus.flush(nc)
    r = await _bus_router(nats_server.url, prefix)
    try:
        assert r.ctx.upstream is not None
        sweep = r.ctx.upstream.sweep
        failed = asyncio.Event()

        def sweep_once_broken() -> None:
            if not failed.is_set():
                failed.set()
                raise KeyError("a bug in one tick")
            sweep()

        r.ctx.upstream.sweep = sweep_once_broken  # type: ignore[method-assign]
        await asyncio.wait_for(failed.wait(), 10)
        seen = len(reports)
        await eventually(
            lambda: len(reports) >= seen + 3,
            timeout=4.0,
            every=0.02,
            what="three more reports after the failed tick",
        )
        assert r.tick_guard.failed == 1
        assert all(not t.done() for t in r._tasks)
    finally:
        await r.stop()


@pytest.mark.parametrize("which", ["router-tick", "router-routing-resync"])
@pytest.mark.slow
async def test_a_loop_that_ends_ends_the_run(nats_server: NatsServer, prefix: str, which: str) -> None:
    r = await _bus_router(nats_server.url, prefix)
    try:
        stop = asyncio.Event()
        run = asyncio.create_task(r.run(stop))
        await asyncio.sleep(0.1)
        assert not run.done()
        loops = [*r._tasks, *(t for f in r._followers for t in f.tasks)]
        # Not one cancel: the tick's nats flush can swallow it (3.11 wait_for; see cancel_and_wait).
        await cancel_and_wait([next(t for t in loops if t.get_name() == which)])
        with pytest.raises(TaskDied) as died:
            await asyncio.wait_for(run, 10)
        # A follower's loop is the bus task's life: its end is reported as the bus task's.
        outer = "router-tick" if which == "router-tick" else "router-bus"
        assert died.value.task_name == outer
        if outer == "router-bus":
            assert isinstance(died.value.__cause__, TaskDied) and died.value.__cause__.task_name == which
    finally:
        await r.stop()
