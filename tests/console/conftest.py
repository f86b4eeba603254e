"""Console fixtures: the console over the fixed fleet (``c``); a live control plane fed by fake agents on
the real nats-server, with the console wired to it exactly as the service does (``CtlApiSource`` over its
``CtlApi``, a ``UsageBook`` fed by the routers' usage subject); and the headless browser when Chromium and
Playwright are installed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import pytest

from llmgw_common.messages import Assignment
from llmgw_common.router_messages import UsageReport
from llmgw_common.subjects import Subjects
from llmgw_controlplane.admin import AdminServer, CtlApiSource, build_admin_app
from llmgw_controlplane.console.usage import UsageBook
from llmgw_controlplane.service import ControlPlane
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable
from tests.console.console_fleet import FixedSource
from tests.console.console_live import (
    DEPS_REASON,
    LIVE_CATALOG,
    LiveConsole,
    chromium_path,
    live_agents,
)
from tests.console.console_pages import client
from tests.kit.poll import eventually


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """Headless Debian Chromium driven by Playwright (never Playwright's own download)."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip(f"playwright is not installed: {DEPS_REASON}")
    exe = chromium_path()
    if exe is None:
        pytest.skip(f"no chromium executable: {DEPS_REASON}")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=exe, headless=True, args=["--disable-gpu"])
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
async def c() -> AsyncIterator[httpx.AsyncClient]:
    """The console over the fixed fleet (console_fleet.py), through the ASGI app."""
    async with client(FixedSource()) as cl:
        yield cl


@pytest.fixture
async def live_console(nats_server: Any, prefix: str, tmp_path: Path) -> AsyncIterator[LiveConsole]:
    """A control plane (in this process, on the real nats-server) with four fake agents and its console."""
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(LIVE_CATALOG)
    s = ControlPlaneSettings(
        nats_urls=[nats_server.url],
        prefix=prefix,
        catalog_file=str(catalog),
        tick_s=0.1,
        heartbeat_interval_s=0.2,
        settle_s=0.0,
        admin_port=0,
    )
    cp_nc = await bus.connect(s, "cp-console-test", wait=False)
    nc = await bus.connect(s, "console-test-agents", wait=False)
    cp = ControlPlane(s, cp_nc)
    await cp.start()
    # The hook the service needs: usage reports into a book, the console over the ctl handlers.
    book = UsageBook()
    usage_sub = await bus.subscribe(
        cp_nc, cp.subjects.all_usage(), UsageReport, lambda rep, _msg: book.add(rep, cp.clock()), cp.drops
    )
    admin = AdminServer(
        build_admin_app(CtlApiSource(cp.api, book)), "127.0.0.1", 0, False, logging.getLogger("test.console")
    )
    port = await admin.start()
    stop = asyncio.Event()
    run = asyncio.create_task(cp.run(stop))
    agents = live_agents(nc, prefix)
    assign_kv = await nc.jetstream().key_value(Subjects(prefix).bucket_assign)
    drops = bus.DropLog(logging.getLogger("test.console"))

    halt = asyncio.Event()

    async def beat() -> None:
        for a in agents:
            await a.send_inventory()
        # Stops on ``halt``, not only on cancel: Python 3.11's wait_for (inside nats-py's request) can
        # swallow a cancellation that races with its reply, and a loop that relies on it never ends.
        while not halt.is_set():
            for a in agents:
                assignment, _ = await bus.kv_get(assign_kv, a.node, Assignment, drops)
                a.serve(assignment)
                await a.beat()
            await asyncio.sleep(0.1)

    beating = asyncio.create_task(beat())

    async def answering() -> bool:
        # Not cp.leader: that flips before the ctl endpoints are registered (a call then meets no responders).
        try:
            return (await CtlClient(nc, prefix, timeout=1.0).status()).leader
        except CtlUnavailable:
            return False

    try:
        await eventually(answering, timeout=30, what="the control plane to answer ctl as leader")
        yield LiveConsole(f"http://127.0.0.1:{port}", cp, CtlClient(nc, prefix), nc, prefix, agents)
    finally:
        halt.set()
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await admin.close()
        stop.set()
        await run
        with contextlib.suppress(nats.errors.ConnectionClosedError):  # a test may have closed it
            await usage_sub.unsubscribe()
        await nc.close()
        await cp_nc.close()
