"""The control plane's loops: a bad pass is counted and reconciling goes on; passes that keep failing,
or a loop that ends, end the run and give the lease up so that a standby takes over at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.ctl import LeaseRecord
from llmgw_common.subjects import LEADER_KEY, Subjects
from llmgw_controlplane import reconcile_loop
from llmgw_controlplane.scheduler.schedule import schedule as real_schedule
from llmgw_controlplane.service import MAX_FAILED_PASSES
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.runtime import FailedPasses, TaskDied, cancel_and_wait
from tests.controlplane.cp_helpers import cp_settings, ctl_answers, start_cp
from tests.kit.cancels import swallows_one_cancel, task_stacks
from tests.kit.poll import eventually


async def _lease(nc: NATS, prefix: str) -> tuple[LeaseRecord | None, int]:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_leader)
    return await bus.kv_get(kv, LEADER_KEY, LeaseRecord)


@pytest.mark.slow
async def test_one_failing_pass_is_counted_and_reconciling_goes_on(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = [0]

    def flaky(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise ZeroDivisionError("one bad input")
        return real_schedule(*a, **kw)

    monkeypatch.setattr(reconcile_loop, "schedule", flaky)
    run = await start_cp(cp_settings(nats_server.url, prefix, lease_ttl_s=30.0))
    try:
        await eventually(lambda: run.cp.passes >= 3, what="three passes despite the failing one")
        assert run.cp.guard.failed == 1 and run.cp.guard.in_a_row == 0
        assert not run.task.done() and run.cp.leader
        await ctl_answers(bus_nc, prefix)
        stats = await CtlClient(bus_nc, prefix, timeout=2.0).debug_stats()
        assert stats.failed_passes == 1
    finally:
        await run.stop()


@pytest.mark.slow
async def test_passes_that_keep_failing_end_the_run_and_release_the_lease(
    nats_server: NatsServer, prefix: str, bus_nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*a: Any, **kw: Any) -> Any:
        raise ZeroDivisionError("every pass")

    monkeypatch.setattr(reconcile_loop, "schedule", broken)
    s = cp_settings(nats_server.url, prefix, lease_ttl_s=3.0)
    a = await start_cp(s, holder="a")
    await eventually(lambda: a.cp.leader, what="a to lead")
    b = await start_cp(s, holder="b", catalog_text=None)
    try:
        with pytest.raises(TaskDied, match="task cp-reconcile raised FailedPasses") as died:
            await asyncio.wait_for(a.task, 20)
        assert isinstance(died.value.__cause__, FailedPasses)
        assert a.cp.guard.in_a_row >= MAX_FAILED_PASSES
        assert not a.cp.leader
        # Given up, not left to lapse: gone at once (unless the standby took it already).
        rec, _ = await _lease(bus_nc, prefix)
        assert rec is None or rec.holder == "b"
        await eventually(lambda: b.cp.leader, timeout=15, what="b to take the released lease")
        rec, _ = await _lease(bus_nc, prefix)
        assert rec is not None and rec.holder == "b"
    finally:
        await b.stop()
        await a.nc.close()


async def test_a_loop_that_ends_ends_the_run_and_releases_the_lease(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    run = await start_cp(cp_settings(nats_server.url, prefix, lease_ttl_s=60.0), holder="a")
    try:
        await eventually(lambda: run.cp.leader, what="the control plane to lead")
        lease_task = next(t for t in run.cp._tasks if t.get_name() == "cp-lease")
        # Not one cancel: a renewal's nats request can swallow it (see cancel_and_wait).
        await cancel_and_wait([lease_task])
        with pytest.raises(TaskDied, match="task cp-lease was cancelled"):
            await asyncio.wait_for(run.task, 10)
        assert run.cp._tasks == []  # the reconcile loop was stopped too
        assert await _lease(bus_nc, prefix) == (None, 0)
    finally:
        await run.nc.close()


@pytest.mark.slow
async def test_stop_ends_a_loop_that_swallowed_a_cancel(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    """Python 3.11's asyncio.wait_for (in nats-py's request, so in a lease renewal or a KV write) drops
    a cancel that lands as its answer arrives (CPython gh-86296). A close() that cancelled the loops
    once then waited for them for ever, and never gave the lease up."""
    run = await start_cp(cp_settings(nats_server.url, prefix, lease_ttl_s=60.0), holder="a")

    stubborn = asyncio.create_task(swallows_one_cancel())
    try:
        # Leading and answering: the take-over has finished (the leader flag flips before it has).
        await ctl_answers(bus_nc, prefix)
        run.cp._tasks.append(stubborn)
        await asyncio.sleep(0)
        run.stop_event.set()
        # Not wait_for: it would cancel run(), and a second cancel is what the fix does.
        done, _ = await asyncio.wait({run.task}, timeout=30)
        if run.task not in done:
            print(task_stacks())  # shown with the failure, even one that pytest-timeout reports
        assert run.task in done and stubborn.done()
        assert await _lease(bus_nc, prefix) == (None, 0)
    finally:
        # Not one cancel each: a failed check must not leave the test waiting on a swallowed one.
        await cancel_and_wait([run.task, stubborn])
        await run.nc.close()
