"""The shared process-group stop, on real child processes: TERM, the grace, KILL, the group whole."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial

import psutil
import pytest

from llmgw_runtime.procgroup import Group, group_members, stop_group_async, stop_groups

# A process that ignores SIGTERM once it says so, and optionally starts `kids` more of itself (same group).
_STUBBORN = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[4], "0", sys.argv[3], sys.argv[4]])
        for _ in range(int(sys.argv[2]))]
time.sleep(0.3 if kids else 0)  # the grandchildren's handlers in place before the parent says ready
print("ready", flush=True)
time.sleep(120)
"""


def _start(term: str, kids: int = 0, kid_term: str = "ignore") -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", _STUBBORN, term, str(kids), _STUBBORN, kid_term]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, process_group=0)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:  # a failed test leaves nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, 9)
        p.wait(5)
        if p.stdout is not None:
            p.stdout.close()


@pytest.mark.slow
def test_a_child_that_ignores_term_is_killed_after_the_grace(started: list[subprocess.Popen[bytes]]) -> None:
    p = _start("ignore")
    started.append(p)
    overdue: list[Group] = []
    t0 = time.monotonic()
    stop_groups([Group(p.pid, 0.8, "stubborn", partial(p.wait, 5))], overdue=overdue.append)
    took = time.monotonic() - t0
    assert 0.8 <= took < 4.0, took
    assert [g.name for g in overdue] == ["stubborn"]
    assert p.returncode == -9  # reaped, by SIGKILL
    assert group_members(p.pid) == []


def test_a_child_that_goes_on_term_is_not_held_for_the_grace(started: list[subprocess.Popen[bytes]]) -> None:
    p = _start("default")
    started.append(p)
    overdue: list[Group] = []
    t0 = time.monotonic()
    stop_groups([Group(p.pid, 30.0, "polite", partial(p.wait, 5))], overdue=overdue.append)
    assert time.monotonic() - t0 < 5.0
    assert overdue == []
    assert p.returncode == -15


@pytest.mark.slow
def test_a_group_with_grandchildren_is_stopped_whole(started: list[subprocess.Popen[bytes]]) -> None:
    # The leader goes on TERM, its two children ignore it: stopping the leader alone would orphan them.
    p = _start("default", kids=2, kid_term="ignore")
    started.append(p)
    kids = psutil.Process(p.pid).children()
    assert len(kids) == 2 and all(os.getpgid(k.pid) == p.pid for k in kids)
    overdue: list[Group] = []
    stop_groups([Group(p.pid, 0.8, "family", partial(p.wait, 5))], overdue=overdue.append)
    assert len(overdue) == 1  # the grandchildren held the group past its grace
    assert group_members(p.pid) == []
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)


@pytest.mark.slow
def test_groups_share_one_grace_and_hurry_cuts_it_short(started: list[subprocess.Popen[bytes]]) -> None:
    a, b = _start("ignore"), _start("ignore")
    started += [a, b]
    t0 = time.monotonic()
    stop_groups([Group(a.pid, 1.5, "a", partial(a.wait, 5)), Group(b.pid, 1.5, "b", partial(b.wait, 5))])
    assert time.monotonic() - t0 < 2.9  # one grace for both, not one each (3 s)
    assert a.returncode == b.returncode == -9

    c = _start("ignore")
    started.append(c)
    t0 = time.monotonic()
    stop_groups([Group(c.pid, 30.0, "c", partial(c.wait, 5))], hurry=lambda: time.monotonic() - t0 > 0.3)
    assert time.monotonic() - t0 < 5.0
    assert c.returncode == -9


def test_a_group_already_gone_is_no_error() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"], process_group=0)
    p.wait()
    stop_groups([Group(p.pid, 5.0, "gone", partial(p.wait, 5))])  # neither raises nor waits the grace
    assert group_members(p.pid) == []


@pytest.mark.slow
async def test_the_async_stop_kills_a_stubborn_group_and_collects_the_leader() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _STUBBORN,
        "ignore",
        "1",
        _STUBBORN,
        "ignore",
        stdout=subprocess.PIPE,
        process_group=0,
    )
    try:
        assert proc.stdout is not None and await proc.stdout.readline() == b"ready\n"
        kid = psutil.Process(proc.pid).children()[0]
        overdue: list[Group] = []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await stop_group_async(proc.pid, 0.8, proc, overdue=overdue.append)
        assert loop.time() - t0 >= 0.8
        assert proc.returncode == -9 and len(overdue) == 1
        assert not kid.is_running() or kid.status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, 9)
            await proc.wait()
