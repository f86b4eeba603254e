"""The notifier's loops: a failing housekeeping pass is counted and the next one runs; a follower's
loop that ends ends the notifier (non-zero exit), rather than leaving it deaf to settings or catalog."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.messages import Webhook
from llmgw_common.subjects import Subjects
from llmgw_notifier import service
from llmgw_notifier.delivery import TargetWorker
from llmgw_notifier.stats import NotifierStats
from llmgw_notifier.targets import Targets
from llmgw_runtime import bus
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.runtime import TaskDied, cancel_and_wait
from tests.http_clients import async_client
from tests.kit.cancels import swallows_one_cancel
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
    class DeafFollower(KvFollower):
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


@pytest.mark.slow
async def test_close_ends_a_delivery_worker_that_swallowed_a_cancel(
    nats_server: NatsServer, prefix: str, nc: NATS
) -> None:
    """Python 3.11's asyncio.wait_for, in nats-py's request and so in a worker's fetch or ack, drops a
    cancel that lands as its answer arrives (CPython gh-86296): a close() (or a removed webhook) that
    cancelled the worker once then waited for it for ever."""
    import logging

    from llmgw_common.subjects import Subjects

    kv = await bus.ensure_kv(nc.jetstream(), Subjects(prefix).bucket_desired)
    async with async_client() as http:
        targets = Targets(
            nc=nc,
            js=nc.jetstream(),
            kv_desired=kv,
            subjects=Subjects(prefix),
            settings=fast_settings(nats_server, prefix),
            http=http,
            stats=NotifierStats(),
            drops=bus.DropLog(logging.getLogger("test")),
        )

        stubborn = asyncio.create_task(swallows_one_cancel())
        targets.workers["t"] = (None, stubborn)  # type: ignore[assignment]
        await asyncio.sleep(0)
        closing = asyncio.create_task(targets.close())
        try:
            # Not wait_for: it would cancel close(), whose own suppress would swallow that cancel too.
            done, _ = await asyncio.wait({closing}, timeout=5)
            assert closing in done and stubborn.done()
        finally:
            # Not one cancel each: the stand-in drops its first, and a failed check would then hang.
            await cancel_and_wait([closing, stubborn], again_s=0.05)


class KeepaliveSwallowsOneCancel(TargetWorker):
    """A worker whose keepalive swallows its first cancel, as nats-py's publish of an in-progress ack
    does when it has to wait (its _flush_pending drops CancelledError; the forced flush uses 3.11's
    wait_for, CPython gh-86296); its session stands in for pulling events."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.keeping: asyncio.Task[Any] | None = None

    async def _session(self) -> None:
        await asyncio.sleep(3600)

    async def _keepalive(self) -> None:
        self.keeping = asyncio.current_task()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        while True:
            await asyncio.sleep(3600)


@pytest.mark.slow
async def test_a_cancelled_delivery_worker_ends_a_keepalive_that_swallowed_a_cancel(
    nats_server: NatsServer, prefix: str, nc: NATS
) -> None:
    """A worker's run(), cancelled, cancelled its keepalive once and then waited for it for ever."""
    async with httpx.AsyncClient() as http:
        worker = KeepaliveSwallowsOneCancel(
            target_id="t",
            hook=Webhook(url="http://127.0.0.1:9/hook"),
            since=0.0,
            nc=nc,
            js=nc.jetstream(),
            subjects=Subjects(prefix),
            settings=fast_settings(nats_server, prefix),
            http=http,
            stats=NotifierStats(),
            drops=bus.DropLog(logging.getLogger("test")),
        )
        running = asyncio.create_task(worker.run())
        await eventually(lambda: worker.keeping is not None, what="the keepalive to start")
        running.cancel()
        try:
            # Not wait_for: it would cancel run() again, and that cancel reaches the keepalive too.
            done, _ = await asyncio.wait({running}, timeout=5)
            assert running in done
            assert running.cancelled()
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
