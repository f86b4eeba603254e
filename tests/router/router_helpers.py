"""Helpers for router tests that talk raw HTTP/1.1: bytes on the wire exactly as written."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import psutil
from aiohttp import web

from llmgw_router.routing.breaker import Breaker, BreakerState
from llmgw_router.service import Router
from llmgw_sim import serving as sim_engine
from llmgw_sim.options import SimOptions
from tests.kit.poll import eventually

# The types of the router fixtures (conftest), for the tests' signatures.
EngineFactory = Callable[..., Awaitable[sim_engine.Listening]]
RouterFactory = Callable[..., Awaitable[Router]]
StaticFile = Callable[..., dict[str, Any]]
PortFactory = Callable[[], int]
# Sim engines as processes (start_engine_process) with their URLs.
EngineProcs = list[tuple[subprocess.Popen[bytes], str]]


def breaker_state(b: Breaker) -> BreakerState:
    """``b.state`` read afresh: mypy keeps an ``is`` check's narrowing across the calls that change it."""
    return b.state


async def wait_serving(url: str, proc: asyncio.subprocess.Process, timeout: float = 30.0) -> None:
    """Until a router process started by the test answers ``url`` with a 200; fails at once if it exits."""

    async with aiohttp.ClientSession() as s:

        async def answers() -> bool:
            assert proc.returncode is None, f"the router exited ({proc.returncode}) before serving {url}"
            async with s.get(url) as r:
                return r.status == 200

        await eventually(
            answers, timeout=timeout, every=0.1, tolerate=(aiohttp.ClientError,), what=f"{url} to answer 200"
        )


def router_sockets(port: int) -> int:
    """Accepted sockets of the router listening on ``port``, as the kernel sees them (psutil).

    The router runs in the test's process: its sockets are the ones whose local port is ``port``.
    """
    return sum(
        1
        for c in psutil.Process().net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.raddr and c.status != psutil.CONN_LISTEN
    )


class RawResponse:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader, timeout: float = 10.0) -> RawResponse:
    """One HTTP/1.1 response with a Content-Length (every answer the router makes itself has one)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(n), timeout) if n else b""
    return RawResponse(status, headers, body)


async def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> RawResponse:
    """Send ``data`` as is on a new connection and read one response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await read_response(reader, timeout)
    finally:
        writer.close()
        await writer.wait_closed()


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the peer sends until it closes the connection (raises TimeoutError if it does not)."""
    return await asyncio.wait_for(reader.read(), timeout)


class CountingUpstream:
    """A real HTTP server that answers every POST with ``status`` (an error naming ``message``, or
    ``answer`` when given) and keeps the bodies it got."""

    def __init__(self, status: int, message: str = "", answer: dict[str, Any] | None = None) -> None:
        self.status, self.message, self.answer = status, message, answer
        self.bodies: list[bytes] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    @property
    def hits(self) -> int:
        return len(self.bodies)

    async def _answer(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        body = self.answer if self.answer is not None else {"error": {"message": self.message}}
        return web.json_response(body, status=self.status)

    async def __aenter__(self) -> CountingUpstream:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def start_engine_process(
    model: str, options: SimOptions | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A ``llmgw sim-engine`` process in its own session (``--zero`` timing unless ``options`` say
    otherwise), and its URL once it listens."""
    opts = options if options is not None else SimOptions(port=0, model=model, zero=True)
    proc = subprocess.Popen(
        [*opts.command(), "--log-level", "WARNING"], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert "listening on" in line, line
    url = line.split("listening on ", 1)[1].split()[0]
    return proc, url


def stop_engine_processes(procs: EngineProcs) -> None:
    """Kill each engine's session; one stopped (SIGSTOP) is continued first so nothing stays frozen."""
    for p, _ in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if p.stdout:
            p.stdout.close()
