"""A TCP forwarder in the test's loop that the test can cut: one process's way to the bus, and only its.

Cut, it closes every connection it carries and stops listening (a reconnect is refused at once); restored,
it listens again on the same port."""

from __future__ import annotations

import asyncio
import contextlib

from tests.kit.ports import free_port


class TcpCut:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.upstream_port = host, upstream_port
        self.port = free_port(host)
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    async def restore(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            w.close()
        for t in list(self._pumps):
            t.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_w))
        for src, dst in ((reader, up_w), (up_r, writer)):
            t = asyncio.create_task(self._pump(src, dst))
            self._pumps.add(t)
            t.add_done_callback(self._pumps.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(dst)
            dst.close()
            with contextlib.suppress(ConnectionError, OSError):
                await dst.wait_closed()
