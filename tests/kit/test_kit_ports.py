"""free_port gives a port a server can bind at once, on the host asked for."""

from __future__ import annotations

import socket

from tests.kit.ports import free_port


def test_free_port_can_be_bound_on_its_host() -> None:
    for host in ("127.0.0.1", ""):
        port = free_port(host)
        assert 0 < port < 65536
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, port))  # raises EADDRINUSE if the port was not free
