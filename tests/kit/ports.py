"""A free TCP port for a test's server: the one helper every test and harness uses.

The OS picks it (bind to port 0); a small race remains until the server binds it, which the tests accept
(a server that cannot bind fails at once and says so). Product code has its own, for `llmgw up`
(``llmgw_cli.devcluster.free_port``): tests do not reach into a service for a helper.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` ("" for every interface, as a published container port needs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
