"""The notifier's loops: a failing housekeeping pass is counted and the next one runs; a follower's
loop that ends ends the notifier (non-zero exit), rather than leaving it deaf to settings or catalog."""

from __future__ import annotations

import asyncio

import pytest

from llmgw_common import bus
from llmgw_common.natsserver import NatsServer
from llmgw_common.runtime import TaskDied
from llmgw_notifier import service
from llmgw_notifier.delivery import NotifierStats
from llmgw_notifier.targets import Targets
from tests.kit.poll import eventually
from tests.notifier.notifier_helpers import fast_settings


async def test_a_failing_housekeeping_pass_is_counted_and_the_next_runs(
    nats_server: NatsServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "HOUSEKEEPING_S", 0.05)
    real = Targets.reconcile
    calls = [0]

    async def flaky(self: Targets) -> None:
        calls[0] += 1
        if calls[0] == 2:  # the first is the start's (mark_synced); the second a housekeeping pass
            raise KeyError("a bug in one pass")
        await real(self)

    monkeypatch.setattr(Targets, "reconcile", flaky)
    stop = asyncio.Event()
    task = asyncio.create_task(service.serve(fast_settings(nats_server, prefix), stop, NotifierStats()))
    try:
        await eventually(
            lambda: calls[0] >= 4 or task.done(), what="housekeeping passes to go on after a failure"
        )
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_a_follower_loop_that_ends_ends_the_notifier(
    nats_server: NatsServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class DeafFollower(bus.KvFollower):
        async def _resync_loop(self) -> None:
            if self.name == "catalog":
                return  # as a loop that ends by a bug would
            await super()._resync_loop()

    monkeypatch.setattr(service, "KvFollower", DeafFollower)
    stop = asyncio.Event()
    task = asyncio.create_task(service.serve(fast_settings(nats_server, prefix), stop, NotifierStats()))
    try:
        with pytest.raises(TaskDied, match="task catalog-resync returned"):
            await asyncio.wait_for(task, 15)
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 15)
