"""Where ``llmgw up`` listens, and the checks of its options made before anything starts.

``--host`` is the router's (the OpenAI API) address only. The embedded NATS has no users, so anyone
who reaches it could write assignments (the argv an agent runs); the admin listeners serve the
console and debug endpoints and refuse a non-loopback address themselves. All three stay on
:data:`LOOPBACK` whatever ``--host`` says.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
# Addresses that bind every interface: a client on this machine connects to them through loopback.
_WILDCARDS = frozenset({"0.0.0.0", ""})


def reach_host(host: str) -> str:
    """The address a client on this machine connects to for a listener bound to ``host``."""
    return LOOPBACK if host in _WILDCARDS else host


def host_error(host: str) -> str | None:
    """Why nothing can listen on ``host`` here (bound as the router and the port checks bind), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except socket.gaierror as e:
        return f"--host {host!r}: no such IPv4 address or name ({e.strerror})"
    except OSError as e:
        return (
            f"--host {host!r}: cannot listen there ({e.strerror}); "
            f"{LOOPBACK} for this machine only, 0.0.0.0 for every interface"
        )
    return None


def port_error(flag: str, port: int, *, free: int) -> str | None:
    """Why ``port`` is no port for ``flag`` (``free``: the value asking for a free one, 0 or -1)."""
    low = 0 if free == 0 else 1
    if port == free or low <= port <= 65535:
        return None
    return f"{flag} {port}: a port is {low}-65535 ({free}: a free one)"


def option_errors(
    *, host: str, port: int, admin_port: int, nats_port: int, ready_timeout_s: float
) -> list[str]:
    """Everything wrong with these options, each in one line naming the flag."""
    errors = [
        host_error(host),
        port_error("--port", port, free=0),
        port_error("--admin-port", admin_port, free=0),
        port_error("--nats-port", nats_port, free=-1),
    ]
    if not ready_timeout_s > 0:
        errors.append(f"--ready-timeout {ready_timeout_s:g}: must be more than 0 seconds")
    return [e for e in errors if e is not None]
