"""`llmgw up --host 0.0.0.0` serves: the router on every interface, NATS and the admin listeners on
loopback (they refuse anything else, which used to kill the run with a traceback)."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from tests.e2e.e2e_cluster import chat_once, start_up, stop_up

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("e2e")]


def listening(pid: int) -> dict[int, str]:
    """Port -> bound address of every TCP listener of ``pid`` and its descendants."""
    out: dict[int, str] = {}
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out[c.laddr.port] = c.laddr.ip
    return out


def test_host_0_0_0_0_serves_the_router_everywhere_and_keeps_the_rest_on_loopback(tmp_path: Path) -> None:
    cluster = start_up(tmp_path / "data", "--host", "0.0.0.0")
    try:
        assert "Traceback" not in cluster.output()
        assert "(the router listens on 0.0.0.0)" in cluster.output()
        r = chat_once(cluster, str(cluster.state["model"]))
        assert r.status_code == 200, r.text
        ports = listening(cluster.proc.pid)
        router_port = int(cluster.router_url.rsplit(":", 1)[1])
        assert ports[router_port] == "0.0.0.0"
        nats_port = int(cluster.nats_url.rsplit(":", 1)[1])
        console_port = int(str(cluster.state["console_url"]).rstrip("/").rsplit(":", 1)[1])
        admin_port = int(str(cluster.state["router_admin_url"]).rstrip("/").rsplit(":", 1)[1])
        for port in (nats_port, console_port, admin_port):
            assert ports[port] == "127.0.0.1", (port, ports)
        # Reachable through a non-loopback address of this machine, when it has one.
        addrs = [
            a.address
            for nics in psutil.net_if_addrs().values()
            for a in nics
            if a.family == socket.AF_INET and not a.address.startswith("127.")
        ]
        if addrs:
            with socket.create_connection((addrs[0], router_port), timeout=5):
                pass
    finally:
        assert stop_up(cluster) == 0, cluster.diagnostics()
