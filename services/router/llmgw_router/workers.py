"""``llmgw router --workers N``: N router processes on one host, sharing the OpenAI port.

One router process tops out near one core (its Python is single-threaded); routers are stateless, so
more of them on one host is more throughput. Each worker is a full router (its own bus connection,
followers, reports, metrics) with the id ``<router_id>-w<i>`` and SO_REUSEPORT on the OpenAI listener:
the kernel spreads new connections over the workers' sockets. Each worker's admin listener (when
``admin_port`` is set) is on ``admin_port + i``: metrics are per process, and a scrape of only one
worker would miss the others' counts.

The parent only supervises: SIGTERM or SIGINT stops every worker (each drains as a single router does)
with the shared process-group stop (:mod:`llmgw_runtime.procgroup`); a worker that exits on its own ends
the others and the parent exits with its status, so that `llmgw up`, systemd or Kubernetes restarts the
whole set rather than running one worker short. Each worker is its own process group (a Ctrl-C on the
terminal reaches the parent alone, which then stops the workers) and dies with the parent.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from functools import partial
from multiprocessing.process import BaseProcess
from types import FrameType

from llmgw_router.settings import RouterSettings
from llmgw_runtime.procgroup import Group, die_with_parent, stop_groups
from llmgw_runtime.runtime import EXIT_TASK_DIED


def worker_settings(settings: RouterSettings, index: int) -> RouterSettings:
    """Worker ``index``'s settings: its own router id and admin port."""
    return settings.model_copy(
        update={
            "router_id": f"{settings.router_id}-w{index}",
            "admin_port": settings.admin_port + index if settings.admin_port else 0,
        }
    )


# SIGTERM to SIGKILL for a worker: its drain (the router's 10 s shutdown grace) and its goodbyes on the
# bus fit well inside; past it a hung worker is killed rather than hold the set's exit forever.
WORKER_STOP_GRACE_S = 30.0


def _worker(settings: RouterSettings, follow_bus: bool | None) -> None:
    os.setpgid(0, 0)  # the parent does the same: whichever runs first, the group exists before a stop
    die_with_parent()
    from llmgw_router.service import serve
    from llmgw_runtime.runtime import run_service, setup_logging

    setup_logging(settings.log_level, name=f"router[{settings.router_id}]")
    run_service(lambda stop: serve(settings, stop, follow_bus=follow_bus, reuse_port=True))


def run_workers(settings: RouterSettings, n: int, follow_bus: bool | None) -> int:
    """Start ``n`` workers and wait for them; the exit status for the parent."""
    # fork: the parent has no event loop and no threads yet, and a forked child needs no re-import
    # (spawn would run `python -m llmgw_cli` again, which parses the command line anew).
    ctx = multiprocessing.get_context("fork")
    procs: list[BaseProcess] = []
    stopping = False

    def on_signal(signum: int, _: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    for i in range(n):
        p: BaseProcess = ctx.Process(
            target=_worker, args=(worker_settings(settings, i), follow_bus), name=f"router-w{i}"
        )
        p.start()
        assert p.pid is not None
        with contextlib.suppress(OSError):  # the worker may have done it already
            os.setpgid(p.pid, p.pid)
        procs.append(p)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 0
    while not stopping:
        died = next((p for p in procs if p.exitcode is not None), None)
        if died is not None:
            # A worker ended on its own: stop the rest and report its status (a signal as 128 + n).
            code = died.exitcode or 0
            status = 128 - code if code < 0 else (code or EXIT_TASK_DIED)
            break
        time.sleep(0.2)
    stop_groups(
        [Group(p.pid, WORKER_STOP_GRACE_S, p.name, partial(p.join, 5)) for p in procs if p.pid is not None]
    )
    return status
