"""Stopping a process group whole: SIGTERM to every member, a grace to go, SIGKILL to what is left, the
leader reaped.

One policy for every process llmgw starts: the agent's engines, `llmgw up`'s children, the nats-server
manager's server and the router's workers. The whole group is signalled and waited for, not only its
leader, so a grandchild that ignores SIGTERM (an engine's worker, a shell's child) dies too. The policy is
one generator (:func:`_stop_steps`) that says how long to pause between looks; :func:`stop_groups` sleeps
those pauses, :func:`stop_group_async` awaits them, so blocking and asyncio callers cannot drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import psutil

log = logging.getLogger("llmgw.procgroup")

# After SIGKILL: how long to wait for the kernel to take the group down. Longer only on a stuck D-state
# process, which no signal can end; the caller goes on rather than hang.
KILL_WAIT_S = 5.0
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Group:
    """A process group to stop: its id (the leader's pid), its SIGTERM-to-SIGKILL grace, a name for the
    overdue message, and ``reap``: collects the leader's exit when it is the caller's child, called once
    the group has no live member (``partial(Popen.wait, 5)``, ``partial(Process.join, 5)``), so that it
    is not left a zombie. A blocking wait, not a poll: a poll finds nothing while another thread waits."""

    pgid: int
    grace_s: float
    name: str = ""
    reap: Callable[[], object] | None = None


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to every member of the group; a group already gone (or not ours) is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


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


def _gone(g: Group) -> bool:
    if group_members(g.pgid):
        return False
    if g.reap is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            g.reap()  # the leader is dead by now (a zombie at most): this returns at once
    return True


def _log_overdue(g: Group) -> None:
    log.info(
        "process group %d%s outlived %.1fs grace: SIGKILL",
        g.pgid,
        f" ({g.name})" if g.name else "",
        g.grace_s,
    )


def _stop_steps(
    groups: Sequence[Group],
    hurry: Callable[[], bool],
    overdue: Callable[[Group], None],
    clock: Callable[[], float],
) -> Iterator[float]:
    """The stop, yielding each pause the caller is to sleep before the next look."""
    for g in groups:
        signal_group(g.pgid, signal.SIGTERM)
    # One clock for all the groups: n hung groups cost one grace, not n.
    start = clock()
    for g in groups:
        deadline = start + g.grace_s
        while not _gone(g):
            if hurry():
                break
            if clock() >= deadline:
                overdue(g)
                break
            yield POLL_S
        else:
            continue  # gone within its grace
        signal_group(g.pgid, signal.SIGKILL)
        kill_deadline = clock() + KILL_WAIT_S
        while not _gone(g) and clock() < kill_deadline:
            yield POLL_S


def stop_groups(
    groups: Sequence[Group],
    *,
    hurry: Callable[[], bool] = lambda: False,
    overdue: Callable[[Group], None] = _log_overdue,
) -> None:
    """Stop ``groups`` together, blocking: SIGTERM to all, each its grace from the same start (cut short
    once ``hurry()`` is true), then SIGKILL to what is left of each; ``overdue`` hears of each that
    outlived its grace (by default a log line)."""
    for pause in _stop_steps(groups, hurry, overdue, time.monotonic):
        time.sleep(pause)


async def stop_group_async(
    pgid: int,
    grace_s: float,
    proc: asyncio.subprocess.Process | None = None,
    *,
    overdue: Callable[[Group], None] = _log_overdue,
) -> None:
    """:func:`stop_groups` for one group, on the event loop; ``proc`` (the leader, when this process
    started it) is awaited at the end so its exit status is collected."""
    loop = asyncio.get_running_loop()
    for pause in _stop_steps([Group(pgid, grace_s)], lambda: False, overdue, loop.time):
        await asyncio.sleep(pause)
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):
            await proc.wait()


def die_with_parent() -> None:
    """In a child (after fork, before exec or the child's own work): SIGTERM to it when its parent dies,
    even by SIGKILL, so a killed supervisor leaves no child of its own group behind (Linux only; a
    no-op elsewhere). The parent's *thread* that forked counts as the parent: fork from the main one."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
