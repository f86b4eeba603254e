"""A flush cut short must leave the connection reading.

nats-py answers a flush when the server's PONG arrives, by setting the result of the flush's future; if
that future was cancelled first (the caller's task cancelled, or the flush's own timeout) the PONG
raises InvalidStateError in the client's read loop, which then ends. The connection still says it is
connected but reads nothing (no message, no reply, no PONG) until the stale-ping check reconnects it
some seconds later. A control plane whose lease task was cancelled inside a flush then took 10 s more
to give the lease up.
"""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.settings import BusSettings


async def _hears(nc: NATS, subject: str) -> bool:
    """Whether a message published now comes back within 3 s (the stale-ping check takes 6 s or more)."""
    got = asyncio.Event()

    async def cb(_: Msg) -> None:
        got.set()

    sub = await nc.subscribe(subject, cb=cb)
    await nc.publish(subject, b"x")
    try:
        await asyncio.wait_for(got.wait(), 3)
        return True
    except TimeoutError:
        return False
    finally:
        await sub.unsubscribe()


async def test_a_cancelled_flush_leaves_the_connection_reading(nats_server: NatsServer, prefix: str) -> None:
    nc = await bus.connect(BusSettings(nats_urls=[nats_server.url], prefix=prefix), "t", wait=False)
    try:
        t = asyncio.create_task(bus.sent(nc))
        await asyncio.sleep(0)  # the PING is out and its PONG awaited
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.2)  # the PONG arrives
        assert await _hears(nc, f"{prefix}.t.cancelled")
        await bus.sent(nc)  # and a flush after it is answered
    finally:
        await nc.close()


async def test_a_flush_that_timed_out_leaves_the_connection_reading(
    nats_server: NatsServer, prefix: str
) -> None:
    nc = await bus.connect(BusSettings(nats_urls=[nats_server.url], prefix=prefix), "t", wait=False)
    try:
        with pytest.raises(nats.errors.FlushTimeoutError):
            await bus.flush(nc, timeout=1e-6)  # gives up before the PONG can arrive
        await asyncio.sleep(0.2)  # the PONG arrives
        assert await _hears(nc, f"{prefix}.t.timedout")
        await bus.flush(nc, timeout=5)
    finally:
        await nc.close()
