"""Engine supervision: start shards in their own process groups, watch them, stop them without orphans.

One monitor task per shard: wait for health up to the shard's startup timeout, report ready, then
watch for an exit or ``health_failures`` failed checks in a row, either of which ends in ``failed``
with the last lines of the engine's output. Stopping is the whole process group (llmgw_runtime.procgroup).
Every change of the running engines is written to the state file (statefile.py), so that an agent
that was killed re-adopts them after a restart instead of restarting them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from llmgw_agent import statefile
from llmgw_agent.adoption import ready_at_adoption
from llmgw_agent.converge import ShardKey, assignment_fingerprint
from llmgw_agent.enginelogs import open_log, read_tail, safe_name
from llmgw_agent.engines import LaunchSpec
from llmgw_agent.probes import Probes
from llmgw_agent.procgroups import engine_environ, exit_reason, port_free, same_process
from llmgw_agent.statefile import EngineRecord
from llmgw_common.messages import ShardAssignment, ShardReport, ShardState
from llmgw_runtime.procgroup import stop_group_async
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.agent.supervisor")


@dataclass(eq=False)
class Shard:
    assignment: ShardAssignment
    spec: LaunchSpec | None
    log_path: Path
    state: ShardState = ShardState.STARTING
    since: float = 0.0
    error: str | None = None
    log_tail: tuple[str, ...] = ()
    pid: int | None = None
    pgid: int | None = None
    create_time: float | None = None
    started_at: float = 0.0
    adopted: bool = False
    proc: asyncio.subprocess.Process | None = None
    # Our own child's exit, awaited once (adopted engines are not our children: polled instead).
    exit_task: asyncio.Task[int] | None = field(default=None, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def key(self) -> ShardKey:
        return (self.assignment.replica_id, self.assignment.shard)

    @property
    def fingerprint(self) -> str:
        return assignment_fingerprint(self.assignment)

    def report(self) -> ShardReport:
        a = self.assignment
        return ShardReport(
            replica_id=a.replica_id,
            shard=a.shard,
            model=a.model,
            state=self.state,
            port=a.port,
            pid=self.pid,
            error=self.error,
            since=self.since,
        )


OnChange = Callable[[Shard], Awaitable[None]]


# ------------------------------------------------------------------ the supervisor


class Supervisor:
    """Owns this node's engine processes. Single event loop; every method is called from it."""

    def __init__(
        self,
        state_dir: str | Path,
        on_change: OnChange,
        *,
        stop_grace_s: float = 10.0,
        health_interval_s: float = 1.0,
        health_failures: int = 3,
        headless_settle_s: float = 1.0,
        quiesce_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.on_change = on_change
        self.stop_grace_s = stop_grace_s
        self.health_interval_s = health_interval_s
        self.health_failures = health_failures
        self.headless_settle_s = headless_settle_s
        self.quiesce_s = quiesce_s
        self.clock = clock
        self.shards: dict[ShardKey, Shard] = {}
        self._probes = Probes()

    # ---------------------------------------------------------------- state file

    @property
    def state_path(self) -> Path:
        return self.state_dir / statefile.STATE_FILE

    def load_state(self) -> list[EngineRecord]:
        """Engines of a previous agent run that are still alive (same PID and start time)."""
        return statefile.read_alive(self.state_path)

    def _save_state(self) -> None:
        statefile.write(
            self.state_path,
            [
                EngineRecord(
                    replica_id=sh.assignment.replica_id,
                    shard=sh.assignment.shard,
                    model=sh.assignment.model,
                    pid=sh.pid,
                    pgid=sh.pgid,
                    port=sh.assignment.port,
                    fingerprint=sh.fingerprint,
                    create_time=sh.create_time,
                    started_at=sh.started_at,
                    argv_hash=sh.spec.argv_hash if sh.spec is not None else "",
                )
                for sh in self.shards.values()
                if sh.pid is not None and sh.pgid is not None and sh.create_time is not None
            ],
        )

    # ---------------------------------------------------------------- queries

    def reports(self) -> tuple[ShardReport, ...]:
        return tuple(sh.report() for sh in sorted(self.shards.values(), key=lambda s: s.key))

    def ready(self) -> list[Shard]:
        return [sh for sh in self.shards.values() if sh.state is ShardState.READY]

    def log_path(self, a: ShardAssignment) -> Path:
        return self.state_dir / "logs" / f"{safe_name(a.replica_id)}-{a.shard}.log"

    # ---------------------------------------------------------------- transitions

    async def _set(self, sh: Shard, state: ShardState, error: str | None = None) -> None:
        sh.state = state
        sh.since = self.clock()
        sh.error = error
        log.info(
            "shard %s/%d (%s) %s%s", sh.key[0], sh.key[1], sh.assignment.model, state.value,
            f": {error}" if error else "",
        )  # fmt: skip
        await self.on_change(sh)

    async def refuse(self, a: ShardAssignment, reason: str) -> None:
        """Record a shard this node will not run, as failed with the reason."""
        sh = Shard(assignment=a, spec=None, log_path=self.log_path(a))
        self.shards[sh.key] = sh
        await self._set(sh, ShardState.FAILED, reason)

    async def start(self, a: ShardAssignment, spec: LaunchSpec) -> None:
        sh = Shard(assignment=a, spec=spec, log_path=self.log_path(a))
        self.shards[sh.key] = sh
        if not port_free(spec.bind_host, a.port):
            await self._set(sh, ShardState.FAILED, f"port {a.port} already in use")
            return
        try:
            fd = open_log(sh.log_path)
        except OSError as e:
            await self._set(
                sh, ShardState.FAILED, f"cannot write engine log {sh.log_path}: {e.strerror or e}"
            )
            return
        try:
            sh.proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=fd,
                stderr=asyncio.subprocess.STDOUT,
                env={**engine_environ(spec.unset), **spec.env},
                start_new_session=True,
            )
        except OSError as e:
            await self._set(sh, ShardState.FAILED, f"cannot start {spec.argv[0]}: {e.strerror or e}")
            return
        finally:
            os.close(fd)
        sh.pid = sh.pgid = sh.proc.pid
        sh.exit_task = asyncio.create_task(sh.proc.wait(), name=f"exit-{a.replica_id}-{a.shard}")
        sh.started_at = self.clock()
        try:
            sh.create_time = psutil.Process(sh.pid).create_time()
        except psutil.NoSuchProcess:
            sh.create_time = None  # exited already: the monitor reports it
        self._save_state()
        await self._set(sh, ShardState.STARTING)
        sh.task = asyncio.create_task(self._monitor(sh), name=f"shard-{a.replica_id}-{a.shard}")

    async def adopt(self, rec: EngineRecord, a: ShardAssignment, spec: LaunchSpec) -> None:
        """Take over an engine a previous run started: ready when it answers now, else judged as a new one."""
        sh = Shard(
            assignment=a,
            spec=spec,
            log_path=self.log_path(a),
            pid=rec.pid,
            pgid=rec.pgid,
            create_time=rec.create_time,
            started_at=rec.started_at,
            adopted=True,
        )
        self.shards[sh.key] = sh
        self._save_state()
        age = self.clock() - rec.started_at
        ready = await ready_at_adoption(spec, age, self.headless_settle_s, self._probes.healthy)
        log.info("re-adopting %s/%d (pid %d, ready: %s)", rec.replica_id, rec.shard, rec.pid, ready)
        await self._set(sh, ShardState.READY if ready else ShardState.STARTING)
        sh.task = asyncio.create_task(self._monitor(sh), name=f"shard-{a.replica_id}-{a.shard}")

    async def stop_orphan(self, rec: EngineRecord) -> None:
        """Stop an engine of a previous run that is no longer assigned."""
        log.info("stopping %s/%d (pid %d): no longer assigned", rec.replica_id, rec.shard, rec.pid)
        if same_process(rec.pid, rec.create_time):
            await stop_group_async(rec.pgid, self.stop_grace_s)

    async def stop(self, key: ShardKey, quiesce: bool = False) -> None:
        """Stop one shard: its monitor first (so the exit is not a failure), then the process group.

        With ``quiesce`` (a stop the assignment asked for), a ready engine is first reported stopping (so
        it leaves the routers' endpoints) and given up to ``quiesce_s`` to finish the requests it holds:
        an engine aborts them when it is stopped, and a drain must not drop one (ARCHITECTURE #8).
        """
        sh = self.shards.get(key)
        if sh is None:
            return
        await self._cancel_monitor(sh)
        if sh.pgid is not None and sh.state is not ShardState.FAILED:
            was_ready = sh.state is ShardState.READY
            await self._set(sh, ShardState.STOPPING)
            if quiesce and was_ready and self.quiesce_s > 0 and sh.spec is not None:
                await self._probes.quiesce(sh.spec, self.quiesce_s, f"{key[0]}/{key[1]}")
            await stop_group_async(sh.pgid, self.stop_grace_s, sh.proc)
        await self._cancel_exit_task(sh)
        self.shards.pop(key, None)
        self._save_state()
        await self._set(sh, ShardState.STOPPED)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(k) for k in list(self.shards)))

    async def aclose(self) -> None:
        for sh in self.shards.values():
            await self._cancel_monitor(sh)
            await self._cancel_exit_task(sh)
        await self._probes.aclose()

    async def _cancel_monitor(self, sh: Shard) -> None:
        t, sh.task = sh.task, None
        if t is not None and t is not asyncio.current_task():
            # Not one cancel: a state report's publish can swallow it when it has to wait (nats-py's
            # _flush_pending drops CancelledError; its forced flush uses 3.11's wait_for, see cancel_and_wait).
            await cancel_and_wait([t])
            if not t.cancelled() and (e := t.exception()) is not None:
                raise e  # a monitor that crashed, as a plain await of it would

    @staticmethod
    async def _cancel_exit_task(sh: Shard) -> None:
        t, sh.exit_task = sh.exit_task, None
        if t is not None and not t.done():
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # ---------------------------------------------------------------- monitoring

    async def _exited(self, sh: Shard, timeout: float) -> tuple[bool, int | None]:
        """Wait up to ``timeout`` for the engine to exit; (exited, exit code or None if unknown)."""
        if sh.exit_task is not None:
            done, _ = await asyncio.wait({sh.exit_task}, timeout=timeout)
            return (True, sh.exit_task.result()) if done else (False, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if sh.pid is None or sh.create_time is None or not same_process(sh.pid, sh.create_time):
                return True, None
            left = deadline - loop.time()
            if left <= 0:
                return False, None
            await asyncio.sleep(min(0.25, left))

    async def _fail(self, sh: Shard, reason: str) -> None:
        if sh.pgid is not None:
            await stop_group_async(sh.pgid, self.stop_grace_s, sh.proc)
        sh.log_tail = read_tail(sh.log_path)
        await self._cancel_exit_task(sh)
        sh.pid = sh.pgid = sh.create_time = None
        self._save_state()
        await self._set(sh, ShardState.FAILED, reason)

    async def _monitor(self, sh: Shard) -> None:
        assert sh.spec is not None
        loop = asyncio.get_running_loop()
        url = sh.spec.health_url
        timeout = sh.assignment.startup_timeout_s
        deadline = loop.time() + (timeout if url is not None else self.headless_settle_s)
        last = "no answer yet"
        # A re-adopted engine that answered at adoption is ready already: only watched.
        while sh.state is not ShardState.READY:
            if url is not None:
                why = await self._probes.healthy(url)
                if why is None:
                    await self._set(sh, ShardState.READY)
                    break
                last = why
            elif loop.time() >= deadline:
                await self._set(sh, ShardState.READY)
                break
            if loop.time() >= deadline:
                await self._fail(sh, f"not healthy after {timeout:g}s ({last})")
                return
            exited, code = await self._exited(sh, 0.25)
            if exited:
                await self._fail(sh, f"{exit_reason(code)} during startup")
                return
        failures = 0
        while True:
            exited, code = await self._exited(sh, self.health_interval_s)
            if exited:
                await self._fail(sh, exit_reason(code))
                return
            if url is None:
                continue
            why = await self._probes.healthy(url)
            failures = 0 if why is None else failures + 1
            if why is not None and failures >= self.health_failures:
                await self._fail(sh, f"health check failed {failures} times in a row ({why})")
                return
