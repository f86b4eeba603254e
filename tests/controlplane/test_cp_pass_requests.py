"""PassRequests: the one way to bring the reconcile loop's next pass forward, with the reasons counted."""

from __future__ import annotations

import asyncio

from llmgw_controlplane.pass_requests import PassReason, PassRequests


async def test_a_request_ends_the_wait_with_its_reasons_and_is_counted() -> None:
    pr = PassRequests()
    waiting = asyncio.create_task(pr.wait(30))
    await asyncio.sleep(0)
    pr.request(PassReason.REPORT)
    pr.request(PassReason.REPORT)
    pr.request(PassReason.DESIRED)
    got = await asyncio.wait_for(waiting, 5)
    assert got == {PassReason.REPORT, PassReason.DESIRED}
    assert pr.counts[PassReason.REPORT] == 2 and pr.counts[PassReason.DESIRED] == 1
    assert pr.counts[PassReason.WAKE] == 0
    assert pr.pending == frozenset()


async def test_the_tick_comes_first_when_nothing_asks() -> None:
    pr = PassRequests()
    assert await pr.wait(0.01) == frozenset()


async def test_a_request_made_during_a_pass_is_kept_for_the_next_wait() -> None:
    pr = PassRequests()
    pr.request(PassReason.TENURE)
    assert await pr.wait(30) == {PassReason.TENURE}
    # The pass runs now; an eviction frees room and asks again: the next wait returns at once.
    pr.request(PassReason.ROOM_FREED)
    assert pr.pending == {PassReason.ROOM_FREED}
    assert await asyncio.wait_for(pr.wait(30), 1) == {PassReason.ROOM_FREED}
    # Taken: the one after waits for its timeout.
    assert await pr.wait(0.01) == frozenset()
