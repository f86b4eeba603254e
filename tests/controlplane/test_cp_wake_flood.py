"""A flood of wake requests on the real bus: one answer computed per model while nothing changed.

A wake answer for a model that does not fit searches placements (~80 ms on 64 nodes of 8 cards, see
bench note in wakes.py); answered once per message, a router-role process sending a few dozen wakes a
second would hold the control plane's event loop, its lease renewal and reconcile pass included.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from nats.aio.client import Client as NATS

from llmgw_common.codec import decode, encode
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState
from llmgw_common.subjects import Subjects
from llmgw_controlplane.wakes import MEMO_MAX, WakeResponder
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually


class _Answers:
    """The control plane's side, counted: what it computed, for which model."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, req: WakeRequest) -> WakeReply:
        self.asked.append(req.model)
        return WakeReply(model=req.model, state=WakeState.WAKING, reason=f"answer {len(self.asked)}")


async def _flood(nc: NATS, prefix: str, models: list[str]) -> list[WakeReply]:
    subj = Subjects(prefix)

    async def one(m: str) -> WakeReply:
        req = WakeRequest(model=m, router="r1", sent_at=time.time())
        return decode((await nc.request(subj.wake("r1"), encode(req), timeout=10)).data, WakeReply)

    return list(await asyncio.gather(*(one(m) for m in models)))


async def test_a_flood_of_wakes_for_one_model_computes_one_answer(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    now = [100.0]
    version = [1]
    answers = _Answers()
    responder = WakeResponder(
        Subjects(prefix).all_wake(),
        answers,
        bus.DropLog(logging.getLogger("t")),
        version=lambda: version[0],
        clock=lambda: now[0],
    )
    await responder.start(bus_nc)
    try:
        replies = await _flood(bus_nc, prefix, ["a"] * 200)
        assert {r.reason for r in replies} == {"answer 1"} and responder.answered == 200
        assert answers.asked == ["a"]
        # Another model is its own answer; the same one is reused while nothing changed.
        await _flood(bus_nc, prefix, ["b", "a"])
        assert answers.asked == ["a", "b"]
        # The tables changed: answered afresh.
        version[0] = 2
        assert (await _flood(bus_nc, prefix, ["a"]))[0].reason == "answer 3"
        # Time passed (a young replica ages, idleness becomes known): answered afresh.
        now[0] += 1.5
        assert (await _flood(bus_nc, prefix, ["a"]))[0].reason == "answer 4"
        # Leading again later: nothing of the old tenure is reused.
        await responder.stop()
        await responder.start(bus_nc)
        assert (await _flood(bus_nc, prefix, ["a"]))[0].reason == "answer 5"
    finally:
        await responder.stop()


@pytest.mark.slow
async def test_wakes_for_invented_models_do_not_grow_memory(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    answers = _Answers()
    responder = WakeResponder(
        Subjects(prefix).all_wake(), answers, bus.DropLog(logging.getLogger("t")), version=lambda: 1
    )
    await responder.start(bus_nc)
    try:
        names = [f"invented-{i}" for i in range(MEMO_MAX * 2 + 10)]
        for i in range(0, len(names), 500):
            await _flood(bus_nc, prefix, names[i : i + 500])
        await eventually(
            lambda: responder.answered == len(names), what="every invented model's wake answered"
        )
        assert len(responder._memo) <= MEMO_MAX
    finally:
        await responder.stop()


async def test_a_wake_for_a_huge_or_invalid_name_is_refused_shortly_without_asking(
    nats_server: NatsServer, prefix: str, bus_nc: NATS
) -> None:
    answers = _Answers()
    responder = WakeResponder(
        Subjects(prefix).all_wake(), answers, bus.DropLog(logging.getLogger("t")), version=lambda: 1
    )
    await responder.start(bus_nc)
    try:
        # ~600 kB: echoed twice in the answer, the reply would exceed the server's 1 MB payload limit and
        # the router would wait out its timeout instead of hearing no.
        for name in ["m" * 600_000, "a b", "x\x1b]8;;http://evil\x07"]:
            (reply,) = await _flood(bus_nc, prefix, [name])
            assert reply.state is WakeState.REFUSED and "not a model name" in reply.reason
            assert len(reply.model) + len(reply.reason) < 1000
        assert answers.asked == [] and not responder._memo
    finally:
        await responder.stop()
