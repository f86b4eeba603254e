"""Engine processes as process groups: a free port, the group's live members, the very process that was
started (not a recycled PID), and a stop that leaves no orphan: SIGTERM to the whole group, a grace
period, then SIGKILL to whatever of the group is left, so a grandchild that ignores SIGTERM dies too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket

import psutil

log = logging.getLogger("llmgw.agent.supervisor")


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


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    try:
        os.killpg(pgid, 0)  # cheap: no member at all (not even a zombie) ends it here
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    out = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                continue
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError, psutil.AccessDenied):
            continue
        out.append(pid)
    return out


def same_process(pid: int, create_time: float) -> bool:
    """The PID is alive and is the very process that was started (not a recycled PID)."""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


async def terminate_group(pgid: int, grace_s: float, proc: asyncio.subprocess.Process | None = None) -> None:
    """SIGTERM to the group, up to ``grace_s`` for it to go, then SIGKILL to whatever is left."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = loop.time() + grace_s
    while group_members(pgid) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if group_members(pgid):
        log.info("process group %d outlived %.1fs grace: SIGKILL", pgid, grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = loop.time() + 5.0
        while group_members(pgid) and loop.time() < deadline:
            await asyncio.sleep(0.05)
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()


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


def engine_environ() -> dict[str, str]:
    """The environment an engine inherits: the agent's, minus its bus credentials."""
    return {k: v for k, v in os.environ.items() if k not in _AGENT_SECRETS}
