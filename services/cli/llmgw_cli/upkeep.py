"""Keeping a served `llmgw up` whole: a child (or the embedded nats-server) that dies is announced and
started again after a backoff (:mod:`llmgw_cli.restarts`), until the run is stopped.

Only once the run served a first completion: a child that dies during the start is a configuration
problem, reported with its log by `llmgw up`, not restarted in a loop.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Protocol

from llmgw_cli.devcluster import Supervisor, write_state
from llmgw_cli.restarts import Restarts
from llmgw_cli.upterm import err
from llmgw_runtime.natsserver import NatsServer, NatsServerError

NATS = "nats-server"
SUPERVISE_EVERY_S = 0.5


class Waits(Protocol):
    """What :func:`supervise` needs of `llmgw up`'s stop flag: wait up to ``seconds``, True once set."""

    def wait(self, seconds: float) -> bool: ...


def exit_text(code: int | None) -> str:
    """``exited with code 3``; a signal is named: ``exited with code -9 (SIGKILL)``."""
    if code is not None and code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def supervise(
    stop: Waits,
    sup: Supervisor,
    nats: NatsServer | None,
    state: MutableMapping[str, object],
    restarts: Restarts | None = None,
    *,
    every_s: float = SUPERVISE_EVERY_S,
    state_path: Path | None = None,
    say: Callable[[str], None] = err,
) -> int:
    """Until ``stop``: restart what died, one line per death and per restart; returns 0.

    ``state`` (written to ``state_path`` when given) follows the pids and restart counts.
    """
    restarts = restarts or Restarts()
    nats_since = time.monotonic()

    def record() -> None:
        state["children"] = [
            {
                "name": c.spec.name,
                "pid": c.pid,
                "pgid": c.pgid,
                "restarts": restarts.count.get(c.spec.name, 0),
            }
            for c in sup.children
        ]
        if nats is not None:
            state["nats_pid"] = nats.pid
            state["nats_restarts"] = restarts.count.get(NATS, 0)
        if state_path is not None:
            write_state(state_path, state)

    def noted(name: str, code: int | None, ran_s: float, log: Path) -> None:
        delay = restarts.died(name, ran_s)
        n = restarts.count.get(name, 0) + 1
        say(
            f"llmgw up: {name} {exit_text(code)} after {ran_s:.0f}s; restarting it in {delay:g}s "
            f"(restart {n}); see {log}"
        )

    while not stop.wait(every_s):
        changed = False
        sup.note_descendants()
        if nats is not None:
            proc = nats.proc
            if not restarts.pending(NATS) and (proc is None or proc.poll() is not None):
                code = proc.returncode if proc is not None else None
                noted(NATS, code, time.monotonic() - nats_since, nats.log_file)
            if restarts.due(NATS):
                try:
                    nats.start()  # same port and store: clients reconnect, KV and streams are kept
                except NatsServerError as e:
                    say(f"llmgw up: {NATS} did not start again: {e}")
                    noted(NATS, None, 0.0, nats.log_file)
                else:
                    nats_since = time.monotonic()
                    restarts.restarted(NATS)
                    say(f"llmgw up: {NATS} restarted (pid {nats.pid})")
                    changed = True
        for c in sup.dead():
            name = c.spec.name
            if not restarts.pending(name):
                noted(name, c.proc.returncode, time.monotonic() - c.started_at, c.log_path)
            elif restarts.due(name):
                new = sup.restart(c)
                restarts.restarted(name)
                say(f"llmgw up: {name} restarted (pid {new.pid})")
                changed = True
        if changed:
            record()
    record()
    return 0
