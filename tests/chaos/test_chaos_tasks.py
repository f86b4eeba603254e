"""A real control plane or router whose loop breaks exits non-zero instead of lingering half-alive.

A leader whose reconcile passes keep failing (for a lease TTL) gives the lease up as it exits, so that
a standby leads at its next lease step instead of after the lease lapsed; a router whose tick loop
ends exits so that its supervisor restarts it. Faults are armed in the real processes (faults.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from llmgw_common.ctl import DebugStatsReply
from llmgw_runtime.runtime import EXIT_TASK_DIED
from tests.chaos.chaos_bus import BUS_ERRORS, BusView
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster, Proc
from tests.chaos.chaos_waits import controlplane_up, holder
from tests.chaos.faults import launcher
from tests.kit.poll import eventually, eventually_sync

pytestmark = [pytest.mark.xdist_group("chaos"), pytest.mark.e2e, pytest.mark.slow]

LEASE_TTL_S = 12.0


def wait_exit(p: Proc, timeout: float) -> int:
    popen = p.popen
    assert popen is not None
    try:
        eventually_sync(
            lambda: popen.poll() is not None, timeout=timeout, every=0.05, what=f"{p.name} to exit"
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{p.tail()}") from None
    return popen.returncode


async def test_a_leader_whose_passes_keep_failing_exits_and_gives_the_lease_up(tmp_path: Path) -> None:
    c = ChaosCluster(tmp_path, settings={**AGGRESSIVE, "LLMGW_LEASE_TTL_S": str(LEASE_TTL_S)})
    trigger = tmp_path / "fail-now"
    view: BusView | None = None
    try:
        await asyncio.to_thread(c.start_nats)
        a = c.start_controlplane("cp-a", launcher=launcher("reconcile-raises", trigger))
        view = await BusView.connect(c.nats_url, c.prefix)

        async def a_leads() -> DebugStatsReply | None:
            st = await view.stats()
            return st if st is not None and st.leader and st.passes > 0 else None

        await eventually(
            a_leads, timeout=30, every=0.2, what="cp-a to lead and reconcile", tolerate=BUS_ERRORS
        )
        b = c.start_controlplane("cp-b")
        # The standby is up and listening (past its settling window) before the fault fires.
        await controlplane_up(b)
        await asyncio.sleep(float(AGGRESSIVE["LLMGW_SETTLE_S"]) + 1.0)
        assert b.alive()
        lease, _ = await view.lease()
        assert lease is not None and lease.holder == holder(a)
        await asyncio.to_thread(trigger.touch)
        rc = await asyncio.to_thread(wait_exit, a, 30)
        t_exit = time.monotonic()
        assert rc == EXIT_TASK_DIED, a.tail()
        # Given up, not left to lapse: gone at once (unless the standby took it already).
        lease, _ = await view.lease()
        assert lease is None or lease.holder == holder(b), lease

        async def b_leads() -> DebugStatsReply | None:
            rec, _ = await view.lease()
            st = await view.stats()
            ok = (
                rec is not None and rec.holder == holder(b) and st is not None and st.leader and st.passes > 0
            )
            return st if ok else None

        await eventually(
            b_leads, timeout=30, every=0.05, what="cp-b to lead and reconcile", tolerate=BUS_ERRORS
        )
        took = time.monotonic() - t_exit
        log = a.tail(200)
        print(f"cp-a exited {rc}; cp-b reconciles {took:.2f}s later (lease TTL {LEASE_TTL_S:g}s)")
        assert took < LEASE_TTL_S, log
        assert "reconcile pass failed (10 in a row, 10 in all): RuntimeError: injected fault" in log
        assert (
            "task cp-reconcile raised FailedPasses" in log and f"exiting with status {EXIT_TASK_DIED}" in log
        )
    finally:
        if view is not None:
            await view.close()
        await c.aclose()


def test_a_router_whose_loop_ends_exits_non_zero(tmp_path: Path) -> None:
    c = ChaosCluster(tmp_path)
    trigger = tmp_path / "end-now"
    try:
        c.start_nats()
        r = c.start_router("router", launcher=launcher("router-tick-ends", trigger))
        c.wait_router("router")
        trigger.touch()
        rc = wait_exit(r, 30)
        log = r.tail(50)
        assert rc == EXIT_TASK_DIED, log
        assert "task router-tick returned" in log
    finally:
        c.close()
