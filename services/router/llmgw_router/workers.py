"""``llmgw router --workers N``: N router processes on one host, sharing the OpenAI port.

One router process tops out near one core (its Python is single-threaded); routers are stateless, so
more of them on one host is more throughput. Each worker is a full router (its own bus connection,
followers, reports, metrics) with the id ``<router_id>-w<i>`` and SO_REUSEPORT on the OpenAI listener:
the kernel spreads new connections over the workers' sockets. Each worker's admin listener (when
``admin_port`` is set) is on ``admin_port + i``: metrics are per process, and a scrape of only one
worker would miss the others' counts.

The parent only supervises: SIGTERM or SIGINT is passed on to every worker (each drains as a single
router does); a worker that exits on its own ends the others and the parent exits with its status, so
that `llmgw up`, systemd or Kubernetes restarts the whole set rather than running one worker short.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess
from types import FrameType

from llmgw_common.runtime import EXIT_TASK_DIED
from llmgw_common.settings import RouterSettings


def worker_settings(settings: RouterSettings, index: int) -> RouterSettings:
    """Worker ``index``'s settings: its own router id and admin port."""
    return settings.model_copy(
        update={
            "router_id": f"{settings.router_id}-w{index}",
            "admin_port": settings.admin_port + index if settings.admin_port else 0,
        }
    )


def _worker(settings: RouterSettings, follow_bus: bool | None) -> None:
    from llmgw_common.runtime import run_service, setup_logging
    from llmgw_router.service import serve

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
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)

    for i in range(n):
        p: BaseProcess = ctx.Process(
            target=_worker, args=(worker_settings(settings, i), follow_bus), name=f"router-w{i}"
        )
        p.start()
        procs.append(p)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 0
    while any(p.exitcode is None for p in procs):
        if not stopping:
            died = next((p for p in procs if p.exitcode is not None), None)
            if died is not None:
                # A worker ended on its own: stop the rest and report its status (a signal as 128 + n).
                code = died.exitcode or 0
                status = 128 - code if code < 0 else (code or EXIT_TASK_DIED)
                on_signal(signal.SIGTERM, None)
        time.sleep(0.2)
    return status
