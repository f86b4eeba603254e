"""Engine supervision: start shards in their own process groups, watch them, stop them without orphans.

One monitor task per shard: wait for health up to the shard's startup timeout, report ready, then
watch for an exit or ``health_failures`` failed checks in a row, either of which ends in ``failed``
with the last lines of the engine's output. Stopping is SIGTERM to the whole group, a grace period,
then SIGKILL to whatever of the group is left, so a grandchild that ignores SIGTERM dies too.

A state file (JSON, replaced atomically) lists the running engines with their PID and the kernel's
start time of that PID, so an agent that was killed can tell, after a restart, its own engines from a
recycled PID and re-adopt them instead of restarting them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from llmgw_agent.adoption import ready_at_adoption
from llmgw_agent.converge import assignment_fingerprint
from llmgw_agent.engines import LaunchSpec
from llmgw_agent.metrics import extract_load, parse_prometheus
from llmgw_common.messages import ShardAssignment, ShardReport, ShardState

log = logging.getLogger("llmgw.agent.supervisor")

ShardKey = tuple[str, int]
LOG_TAIL_LINES = 50
MAX_LINE = 1000
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


# ------------------------------------------------------------------ process-level helpers


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


def read_tail(path: Path, lines: int = LOG_TAIL_LINES, max_bytes: int = 64 * 1024) -> tuple[str, ...]:
    """The last ``lines`` lines of a log file (empty when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ()
    text = data.decode("utf-8", errors="replace")
    # Long lines are cut so that a status message stays far below NATS' payload limit.
    return tuple(
        line if len(line) <= MAX_LINE else line[:MAX_LINE] + " …" for line in text.splitlines()[-lines:]
    )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _open_log(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "exited (exit status unknown: adopted after an agent restart)"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


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
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0))

    # ---------------------------------------------------------------- state file

    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def load_state(self) -> list[EngineRecord]:
        """Engines of a previous agent run that are still alive (same PID and start time)."""
        try:
            raw = json.loads(self.state_path.read_text(encoding="utf-8"))
            records = [EngineRecord(**r) for r in raw.get("engines", [])]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("ignoring unreadable state file %s: %s", self.state_path, e)
            return []
        alive = [r for r in records if same_process(r.pid, r.create_time)]
        for r in records:
            if r not in alive:
                log.info("engine %s/%d (pid %d) of a previous run is gone", r.replica_id, r.shard, r.pid)
        return alive

    def _save_state(self) -> None:
        records = [
            asdict(
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
            )
            for sh in self.shards.values()
            if sh.pid is not None and sh.pgid is not None and sh.create_time is not None
        ]
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(
                json.dumps({"version": STATE_VERSION, "engines": records}, indent=1), encoding="utf-8"
            )
            os.replace(tmp, self.state_path)
        except OSError as e:
            # Engines still run and are supervised; only re-adoption after an agent restart is lost.
            log.error(
                "cannot write state file %s (engines will not be re-adopted after a restart): %s",
                self.state_path,
                e,
            )

    # ---------------------------------------------------------------- queries

    def reports(self) -> tuple[ShardReport, ...]:
        return tuple(sh.report() for sh in sorted(self.shards.values(), key=lambda s: s.key))

    def ready(self) -> list[Shard]:
        return [sh for sh in self.shards.values() if sh.state is ShardState.READY]

    def log_path(self, a: ShardAssignment) -> Path:
        return self.state_dir / "logs" / f"{_safe(a.replica_id)}-{a.shard}.log"

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
            fd = _open_log(sh.log_path)
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
                env={**engine_environ(), **spec.env},
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
        ready = await ready_at_adoption(spec, age, self.headless_settle_s, self._healthy)
        log.info("re-adopting %s/%d (pid %d, ready: %s)", rec.replica_id, rec.shard, rec.pid, ready)
        await self._set(sh, ShardState.READY if ready else ShardState.STARTING)
        sh.task = asyncio.create_task(self._monitor(sh), name=f"shard-{a.replica_id}-{a.shard}")

    async def stop_orphan(self, rec: EngineRecord) -> None:
        """Stop an engine of a previous run that is no longer assigned."""
        log.info("stopping %s/%d (pid %d): no longer assigned", rec.replica_id, rec.shard, rec.pid)
        if same_process(rec.pid, rec.create_time):
            await terminate_group(rec.pgid, self.stop_grace_s)

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
            if quiesce and was_ready and self.quiesce_s > 0:
                await self._quiesce(sh)
            await terminate_group(sh.pgid, self.stop_grace_s, sh.proc)
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
        await self._http.aclose()

    async def _cancel_monitor(self, sh: Shard) -> None:
        t, sh.task = sh.task, None
        if t is not None and t is not asyncio.current_task():
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t

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

    async def _quiesce(self, sh: Shard, every: float = 0.2) -> None:
        """Until the engine reports nothing running or waiting twice in a row, or ``quiesce_s`` passed.

        Returns at once when it cannot tell: no metrics, a scrape that fails (the engine is gone), or an
        engine that does not expose a running count.
        """
        spec = sh.spec
        if spec is None or spec.metrics_url is None:
            return
        deadline = time.monotonic() + self.quiesce_s
        quiet = 0
        while True:
            try:
                r = await self._http.get(spec.metrics_url)
                r.raise_for_status()
            except httpx.HTTPError:
                return
            load = extract_load(parse_prometheus(r.text), spec.metrics)
            if load.running is None:
                return
            quiet = quiet + 1 if load.running == 0 and not load.waiting else 0
            if quiet >= 2:
                return
            if time.monotonic() >= deadline:
                log.info(
                    "stopping %s/%d with %g request(s) still running after %gs",
                    sh.assignment.replica_id, sh.assignment.shard, load.running, self.quiesce_s,
                )  # fmt: skip
                return
            await asyncio.sleep(every)

    async def _healthy(self, url: str, timeout: float | None = None) -> str | None:
        """None when healthy, else why not (``timeout``: instead of the client's)."""
        try:
            r = await self._http.get(url, timeout=self._http.timeout if timeout is None else timeout)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}"
        return None if r.status_code == 200 else f"HTTP {r.status_code}"

    async def _fail(self, sh: Shard, reason: str) -> None:
        if sh.pgid is not None:
            await terminate_group(sh.pgid, self.stop_grace_s, sh.proc)
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
                why = await self._healthy(url)
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
                await self._fail(sh, f"{_exit_reason(code)} during startup")
                return
        failures = 0
        while True:
            exited, code = await self._exited(sh, self.health_interval_s)
            if exited:
                await self._fail(sh, _exit_reason(code))
                return
            if url is None:
                continue
            why = await self._healthy(url)
            failures = 0 if why is None else failures + 1
            if why is not None and failures >= self.health_failures:
                await self._fail(sh, f"health check failed {failures} times in a row ({why})")
                return


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
