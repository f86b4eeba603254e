"""``llmgw router --workers N``: N router processes on one port (SO_REUSEPORT), each a full router.

A real process tree against a real nats-server: each worker reports on the bus under its own id, the
kernel spreads new connections over them, every worker serves, and SIGTERM stops them all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest
import yaml
from nats.aio.client import Client as NATS

from llmgw_common.router_messages import UsageReport
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually
from tests.router.router_helpers import EngineFactory, PortFactory, wait_serving

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def _two_free_ports() -> int:
    """A port p with p + 1 free as well (the second worker's admin port)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.slow
async def test_two_workers_share_the_port_and_both_serve(
    nats_server: NatsServer, prefix: str, nc: NATS, engines: EngineFactory, tmp_path: Path, port: PortFactory
) -> None:
    eng = await engines("m1")
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"auth": False, "models": [{"name": "m1", "endpoints": [eng.url]}]}))
    usage: dict[str, UsageReport] = {}
    await bus.subscribe(
        nc,
        Subjects(prefix).all_usage(),
        UsageReport,
        lambda m, _: usage.__setitem__(m.router, m),
        bus.DropLog(logging.getLogger("t")),
    )
    p, admin = port(), _two_free_ports()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw_cli",
        "router",
        "--workers",
        "2",
        "--static",
        str(static),
        "--nats",
        nats_server.url,
        "--prefix",
        prefix,
        "--port",
        str(p),
        "--admin-port",
        str(admin),
        "--router-id",
        "rw",
        start_new_session=True,
        stderr=asyncio.subprocess.DEVNULL,
        env=dict(os.environ, LLMGW_TICK_S="0.2"),
    )
    try:
        for url in (f"http://127.0.0.1:{p}/health", f"http://127.0.0.1:{admin}/health"):
            await wait_serving(url, proc)
        await wait_serving(f"http://127.0.0.1:{admin + 1}/health", proc)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        # A new connection per request: the kernel picks a listening socket per connection.
        n = 40
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            for _ in range(n):
                async with s.post(f"http://127.0.0.1:{p}/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200

        def served(rid: str) -> int:
            rep = usage.get(rid)
            return rep.usage.get("-", {}).get("m1", [0])[0] if rep is not None else 0

        # Each worker reports on the bus under its own id, and each served some of the requests.
        await eventually(
            lambda: served("rw-w0") + served("rw-w1") == n,
            timeout=10.0,
            what="both workers' usage to add up to all requests",
        )
        assert served("rw-w0") > 0 and served("rw-w1") > 0, (served("rw-w0"), served("rw-w1"))
        # Each worker's metrics on its own admin port: admin_port + index.
        async with aiohttp.ClientSession() as s:
            for i in range(2):
                async with s.get(f"http://127.0.0.1:{admin + i}/metrics") as r:
                    text = await r.text()
                line = f'llmgw_router_requests_total{{model="m1",status="200"}} {float(served(f"rw-w{i}"))}'
                assert line in text, (i, [x for x in text.splitlines() if "requests_total" in x])
        os.killpg(proc.pid, signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@pytest.mark.slow
async def test_a_worker_that_dies_ends_the_set_with_its_status(
    engines: EngineFactory, tmp_path: Path, port: PortFactory
) -> None:
    # One worker short would serve on at half the capacity with nobody told: the parent ends the other
    # workers and exits with the dead one's status, so that a supervisor restarts the whole set.
    eng = await engines("m1")
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"auth": False, "models": [{"name": "m1", "endpoints": [eng.url]}]}))
    p = port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "llmgw_cli", "router", "--workers", "2", "--static", str(static), "--port", str(p)),
        start_new_session=True,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_serving(f"http://127.0.0.1:{p}/health", proc)
        parent = psutil.Process(proc.pid)
        await eventually(
            lambda: len(parent.children()) == 2, timeout=10.0, what="the supervisor to have two workers again"
        )
        first, second = parent.children()
        first.kill()
        assert await asyncio.wait_for(proc.wait(), 20) == 128 + signal.SIGKILL
        await eventually(
            lambda: not second.is_running() or second.status() == psutil.STATUS_ZOMBIE,
            timeout=5.0,
            what="the replaced worker to exit",
        )
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def test_workers_need_a_fixed_port(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from llmgw_cli.main import app

    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"models": [{"name": "m1", "endpoints": ["http://127.0.0.1:1"]}]}))
    res = CliRunner().invoke(app, ["router", "--workers", "2", "--port", "0", "--static", str(static)])
    assert res.exit_code == 2 and "--workers needs a fixed --port" in res.stderr, res.stderr
