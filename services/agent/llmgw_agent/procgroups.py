"""Engine processes as process groups: a free port, the very process that was started (not a recycled
PID), the exit reason and the environment an engine inherits. Stopping a group is the shared
:mod:`llmgw_runtime.procgroup`.
"""

from __future__ import annotations

import errno
import os
import signal
import socket

import psutil


def port_free(host: str, port: int) -> bool:
    """True when ``host:port`` can be bound now (SO_REUSEADDR: a TIME_WAIT leftover is no conflict)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def same_process(pid: int, create_time: float) -> bool:
    """The PID is alive and is the very process that was started (not a recycled PID)."""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def exit_reason(code: int | None) -> str:
    if code is None:
        return "exited (exit status unknown: adopted after an agent restart)"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# The agent's own bus credentials: an engine has no business with them (and would leak them into
# its logs or a crash dump).
_AGENT_SECRETS = (
    "LLMGW_NATS_PASSWORD",
    "LLMGW_NATS_TOKEN",
    "LLMGW_NATS_CREDS",
    "LLMGW_NATS_TLS_KEY",
    "LLMGW_NATS_USER",
)


def engine_environ(unset: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment an engine inherits: the agent's, minus its bus credentials and ``unset``."""
    return {k: v for k, v in os.environ.items() if k not in _AGENT_SECRETS and k not in unset}
