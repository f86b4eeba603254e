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
        t = asyncio.create_task(bus.flush(nc))
        await asyncio.sleep(0)  # the PING is out and its PONG awaited
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.2)  # the PONG arrives
        assert await _hears(nc, f"{prefix}.t.cancelled")
        await bus.flush(nc)  # and a flush after it is answered
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


class Recorder:
    """A TCP proxy in front of the real nats-server that keeps what the client wrote, in order."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.wrote = bytearray()
        self.pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.srv = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        port: int = self.srv.sockets[0].getsockname()[1]
        return port

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        up = asyncio.ensure_future(self._pipe(cr, sw, self.wrote))
        down = asyncio.ensure_future(self._pipe(sr, cw, None))
        self.pipes |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        sw.close()
        cw.close()

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, keep: bytearray | None) -> None:
        while data := await r.read(65536):
            if keep is not None:
                keep += data
            w.write(data)
            await w.drain()

    async def close(self) -> None:
        self.srv.close()
        for t in self.pipes:
            t.cancel()
        await asyncio.gather(*self.pipes, return_exceptions=True)


async def test_a_flush_goes_out_after_the_subscription_and_message_before_it(
    nats_server: NatsServer, prefix: str
) -> None:
    """nats-py's own flush writes its PING ahead of the SUB and PUB still in its buffer (the wire reads
    PING, SUB, PUB), so its PONG can come back before the server registered the subscription: seen under
    load as a message, published right after, never delivered. bus.flush's PING follows them."""
    assert nats_server.port is not None
    rec = Recorder(nats_server.port)
    port = await rec.start()
    nc = await bus.connect(
        BusSettings(nats_urls=[f"nats://127.0.0.1:{port}"], prefix=prefix), "t", wait=False
    )
    try:
        await bus.flush(nc)  # the connection's own handshake is out of the way
        mark = len(rec.wrote)
        # 4 MiB on its way: the client's flusher task writes it and waits for the socket to drain.
        for _ in range(8):
            await nc.publish(f"{prefix}.t.bulk", b"y" * 512 * 1024)
        await asyncio.sleep(0)
        await nc.subscribe(f"{prefix}.t.order", cb=_ignore)
        await nc.publish(f"{prefix}.t.other", b"x")
        await bus.flush(nc)
        lines = bytes(rec.wrote[mark:]).split(b"\r\n")
        ops = [ln.split(b" ")[0] for ln in lines if ln.startswith((b"SUB ", b"PUB ", b"PING"))]
        assert ops == [b"PUB"] * 8 + [b"SUB", b"PUB", b"PING"], ops
    finally:
        await nc.close()
        await rec.close()


async def _ignore(_: Msg) -> None:
    return None
