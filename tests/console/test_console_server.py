"""The admin listener on a real socket: loopback by default, an explicit flag and a warning otherwise."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

import httpx
import pytest
from fastapi import FastAPI

from llmgw_controlplane.admin import (
    AdminBindError,
    AdminServer,
    build_admin_app,
    is_loopback,
    serve_admin,
)
from llmgw_controlplane.admin.app import _host_name
from tests.console.console_fleet import FixedSource
from tests.http_clients import async_client

log = logging.getLogger("test.console")


def app() -> FastAPI:
    return build_admin_app(FixedSource())


async def test_serve_admin_on_port_0_reports_port_serves_and_stops() -> None:
    stop = asyncio.Event()
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_admin(app(), "127.0.0.1", 0, False, stop, log, on_bound=bound.set_result)
    )
    port = await asyncio.wait_for(bound, 10)
    assert port > 0
    async with async_client() as c:
        r = await c.get(f"http://127.0.0.1:{port}/nodes")
        assert r.status_code == 200 and "gpu-a01" in r.text
        assert "server" not in r.headers  # no banner of what runs here
        assert (await c.post(f"http://127.0.0.1:{port}/")).status_code == 405
    stop.set()
    await asyncio.wait_for(task, 10)
    with pytest.raises(httpx.ConnectError):
        async with async_client() as c:
            await c.get(f"http://127.0.0.1:{port}/")


async def test_serve_admin_leaves_the_process_signal_handlers_alone() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    server = AdminServer(app(), "127.0.0.1", 0, False, log)
    await server.start()
    try:
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        await server.close()
    await server.close()  # twice is harmless


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "console.example"])
async def test_non_loopback_without_flag_refused(host: str, caplog: pytest.LogCaptureFixture) -> None:
    stop = asyncio.Event()
    with pytest.raises(AdminBindError) as ei:
        await serve_admin(app(), host, 0, False, stop, log)
    msg = str(ei.value)
    assert "not loopback" in msg and "allow_public_admin" in msg and "debug endpoints" in msg
    assert repr(host) in msg


async def test_non_loopback_with_flag_warns_and_serves(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.console")
    server = AdminServer(build_admin_app(FixedSource(), loopback_only=False), "0.0.0.0", 0, True, log)
    port = await server.start()
    try:
        # Its own logger's only: in asyncio debug mode a slow step of the loop is a WARNING too.
        warnings = [r for r in caplog.records if r.name == "test.console" and r.levelno == logging.WARNING]
        assert len(warnings) == 1
        w = warnings[0].getMessage()
        assert "off loopback" in w and "expose the control plane's memory" in w and "0.0.0.0" in w
        async with async_client() as c:
            r = await c.get(f"http://127.0.0.1:{port}/debug/stats")
        assert r.status_code == 200 and r.json()["passes"] == 42
    finally:
        await server.close()


async def test_loopback_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.console")
    server = AdminServer(app(), "127.0.0.1", 0, False, log)
    port = await server.start()
    await server.close()
    assert not [r for r in caplog.records if r.name == "test.console" and r.levelno >= logging.WARNING]
    assert f"console on http://127.0.0.1:{port}/ (read-only)" in caplog.text


async def test_port_in_use_is_a_clear_error() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(
            AdminBindError, match=rf"cannot bind 127.0.0.1:{port} \(.*\); choose another --admin-port"
        ):
            await AdminServer(app(), "127.0.0.1", port, False, log).start()
    finally:
        taken.close()


async def test_unresolvable_public_host_is_a_clear_error() -> None:
    with pytest.raises(AdminBindError, match=r"cannot resolve 'no-such-host\.invalid'"):
        await AdminServer(app(), "no-such-host.invalid", 0, True, log).start()


async def test_ipv6_loopback() -> None:
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    server = AdminServer(app(), "::1", 0, False, log)
    port = await server.start()
    try:
        async with async_client() as c:
            r = await c.get(f"http://[::1]:{port}/models")
        assert r.status_code == 200 and "llama-70b" in r.text
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("host", "loop"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("localhost.example", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8081", "127.0.0.1"),
        ("localhost", "localhost"),
        ("[::1]:8081", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("", ""),
    ],
)
def test_host_name(header: str, name: str) -> None:
    assert _host_name(header) == name


async def test_close_after_the_listener_was_cancelled_or_failed(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = AdminServer(app(), "127.0.0.1", 0, False, log)
    await server.start()
    assert server._task is not None
    server._task.cancel()
    await server.close()  # returns; the cancellation is not the caller's

    caplog.set_level(logging.WARNING, logger="test.console")
    failing = AdminServer(app(), "127.0.0.1", 0, False, log)
    await failing.start()
    assert failing._server is not None and failing._task is not None

    async def broken_tick(counter: int) -> bool:
        raise OSError("tick failed")

    monkeypatch.setattr(failing._server, "on_tick", broken_tick)
    await asyncio.wait({failing._task}, timeout=5)
    await failing.close()
    assert "admin listener ended with an error: tick failed" in caplog.text
