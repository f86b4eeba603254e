"""The agent's state file: the engines it runs, so that an agent that was killed re-adopts them.

JSON, replaced atomically. Each engine is kept with its PID and the kernel's start time of that PID, so
that after a restart the agent can tell its own engines from a recycled PID.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from llmgw_agent.converge import ShardKey
from llmgw_agent.procgroups import same_process

log = logging.getLogger("llmgw.agent.supervisor")

STATE_FILE = "engines.json"
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """One running engine as the state file keeps it."""

    replica_id: str
    shard: int
    model: str
    pid: int
    pgid: int
    port: int
    # Of the assignment (see converge.assignment_fingerprint): what decides re-adoption.
    fingerprint: str
    create_time: float
    started_at: float
    argv_hash: str = ""

    @property
    def key(self) -> ShardKey:
        return (self.replica_id, self.shard)


def read_alive(path: Path) -> list[EngineRecord]:
    """Engines of a previous agent run that are still alive (same PID and start time)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        records = [EngineRecord(**r) for r in raw.get("engines", [])]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, AttributeError) as e:
        log.warning("ignoring unreadable state file %s: %s", path, e)
        return []
    alive = [r for r in records if same_process(r.pid, r.create_time)]
    for r in records:
        if r not in alive:
            log.info("engine %s/%d (pid %d) of a previous run is gone", r.replica_id, r.shard, r.pid)
    return alive


def write(path: Path, records: Iterable[EngineRecord]) -> None:
    """Replace the state file with ``records``; a failure is logged, not raised (see below)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"version": STATE_VERSION, "engines": [asdict(r) for r in records]}, indent=1),
            encoding="utf-8",
        )
        os.replace(tmp, path)
    except OSError as e:
        # Engines still run and are supervised; only re-adoption after an agent restart is lost.
        log.error(
            "cannot write state file %s (engines will not be re-adopted after a restart): %s",
            path,
            e,
        )
