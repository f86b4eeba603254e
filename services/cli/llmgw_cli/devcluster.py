"""The processes of ``llmgw up``: what to start (pure), and starting, watching and stopping them.

Every child is ``python -m llmgw_cli <command>`` in its own process group, so that a Ctrl-C on the
terminal reaches ``llmgw up`` alone and the stop runs in order: the last started is stopped first.
Settings travel by environment (``LLMGW_*``, read by each service's settings class); only the
options every service command shares (``--nats``, ``--prefix``) travel as flags.

A marker variable (:data:`RUN_MARKER`) carrying a per-run token is set in every child's environment;
engines inherit it from their agents. With the recorded process groups and the descendants seen
before the stop, it lets the stop find any process of the run that outlived its parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import psutil

from llmgw_cli.fleet import Fleet
from llmgw_cli.upopts import LOOPBACK, reach_host
from llmgw_runtime.procgroup import Group, die_with_parent, group_members, signal_group, stop_groups

RUN_MARKER = "LLMGW_UP_RUN"
LOCAL_NODE = "local"
# Inherited LLMGW_* variables a child keeps: how to reach and authenticate to NATS, and log level.
# Everything else is set by `llmgw up` itself, so a stray variable in the shell cannot re-point a child.
_PASS_THROUGH = frozenset(
    {
        "LLMGW_NATS_USER",
        "LLMGW_NATS_PASSWORD",
        "LLMGW_NATS_CREDS",
        "LLMGW_NATS_TOKEN",
        "LLMGW_NATS_TLS_CA",
        "LLMGW_NATS_TLS_CERT",
        "LLMGW_NATS_TLS_KEY",
        "LLMGW_LOG_LEVEL",
        # Replicas of buckets a child creates: 3 against a NATS cluster (`up --nats`).
        "LLMGW_KV_REPLICAS",
    }
)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    command: str
    # LLMGW_* settings of this child, on top of the run's common environment.
    env: Mapping[str, str]
    # Stop order: higher tiers stop first; one tier is signalled at once and waited for together.
    tier: int
    # SIGTERM to SIGKILL. Agents get longer: they stop their engines first.
    grace_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Layout:
    """Where things live and listen; decided before anything starts."""

    data_dir: Path
    nats_url: str
    prefix: str
    # The router's address; the admin listeners stay on loopback (see upopts).
    host: str
    router_port: int
    router_admin_port: int
    controlplane_admin_port: int
    catalog_file: Path
    dev_key: str
    local_agent: bool = True
    engine_stop_grace_s: float = 5.0

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def router_url(self) -> str:
        return f"http://{reach_host(self.host)}:{self.router_port}"


def plan_children(layout: Layout, fleet: Fleet) -> list[ChildSpec]:
    """The children of a run in start order: control plane, router, notifier, then the agents."""
    agent_grace = layout.engine_stop_grace_s + 10.0
    specs = [
        ChildSpec(
            "controlplane",
            "controlplane",
            {
                "LLMGW_CATALOG_FILE": str(layout.catalog_file),
                "LLMGW_ADMIN_HOST": LOOPBACK,
                "LLMGW_ADMIN_PORT": str(layout.controlplane_admin_port),
            },
            tier=0,
        ),
        ChildSpec(
            "router",
            "router",
            {
                "LLMGW_ROUTER_ID": "dev",
                "LLMGW_HOST": layout.host,
                "LLMGW_PORT": str(layout.router_port),
                "LLMGW_ADMIN_HOST": LOOPBACK,
                "LLMGW_ADMIN_PORT": str(layout.router_admin_port),
            },
            tier=1,
        ),
        ChildSpec(
            "notifier",
            "notifier",
            {"LLMGW_ROUTER_URL": layout.router_url, "LLMGW_PROBE_KEY": layout.dev_key},
            tier=2,
        ),
    ]
    agents: list[tuple[str, dict[str, str]]] = []
    if layout.local_agent:
        agents.append((LOCAL_NODE, {"LLMGW_NODE": LOCAL_NODE}))
    agents.extend((n.name, n.agent_env()) for n in fleet.nodes)
    for name, env in agents:
        env = {
            **env,
            "LLMGW_ADDRESS": "127.0.0.1",
            "LLMGW_STATE_DIR": str(layout.data_dir / "agents" / name),
            "LLMGW_STOP_GRACE_S": str(layout.engine_stop_grace_s),
        }
        specs.append(ChildSpec(f"agent-{name}", "agent", env, tier=3, grace_s=agent_grace))
    return specs


def child_argv(spec: ChildSpec, layout: Layout) -> list[str]:
    python = sys.executable
    return [python, "-m", "llmgw_cli", spec.command, "--nats", layout.nats_url, "--prefix", layout.prefix]


def child_env(spec: ChildSpec, layout: Layout, run_token: str, base: Mapping[str, str]) -> dict[str, str]:
    """The full environment of a child: ``base`` without foreign LLMGW_* settings, plus its own."""
    env = {k: v for k, v in base.items() if not k.startswith("LLMGW_") or k in _PASS_THROUGH}
    env.update(spec.env)
    env["LLMGW_PREFIX"] = layout.prefix
    env[RUN_MARKER] = run_token
    env["PYTHONUNBUFFERED"] = "1"
    # Children find nats-server and llmgw in this environment's bin whatever PATH the user has.
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        env["PATH"] = os.pathsep.join([bindir, path]) if path else bindir
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` (the OS's choice); a small race remains until the child binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a log file ([] when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    pgid: int
    started_at: float
    # Descendants seen while running (engines live in their own groups under the agents).
    descendants: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class Supervisor:
    """Starts children, tells which died, and stops them all in reverse order leaving nothing behind."""

    def __init__(
        self,
        layout: Layout,
        run_token: str,
        *,
        base_env: Mapping[str, str] | None = None,
        say: Callable[[str], None] = lambda _: None,
        argv_for: Callable[[ChildSpec, Layout], list[str]] = child_argv,
    ) -> None:
        self.layout = layout
        self.argv_for = argv_for
        self.run_token = run_token
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.say = say
        self.children: list[Child] = []
        # Every process group this run ever created or saw, for the last-resort sweep.
        self.pgids: set[int] = set()

    def start(self, spec: ChildSpec) -> Child:
        self.layout.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.layout.logs_dir / f"{spec.name}.log"
        argv = self.argv_for(spec, self.layout)
        env = child_env(spec, self.layout, self.run_token, self.base_env)
        with open(log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        child = Child(spec, proc, log_path, pgid=proc.pid, started_at=time.monotonic())
        self.children.append(child)
        self.pgids.add(child.pgid)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def restart(self, old: Child) -> Child:
        """Start ``old``'s spec again in its place (stop order unchanged); ``old`` must have exited."""
        new = self.start(old.spec)
        self.children.remove(new)
        self.children[self.children.index(old)] = new
        # Engines of a killed agent outlive it (the new agent adopts them): the sweep must still know them.
        new.descendants |= old.descendants
        try:
            os.killpg(old.pgid, 0)
        except ProcessLookupError:
            # Its group is empty: forget it, so that a recycled group id is never swept.
            self.pgids.discard(old.pgid)
        except OSError:
            pass
        return new

    def note_descendants(self) -> None:
        """Remember every descendant's pid and group: the sweep after a stop kills the stragglers."""
        for c in self.children:
            if not c.alive():
                continue
            try:
                kids = psutil.Process(c.pid).children(recursive=True)
            except psutil.Error:
                continue
            for k in kids:
                c.descendants.add(k.pid)
                with contextlib.suppress(OSError):
                    self.pgids.add(os.getpgid(k.pid))

    def stop_all(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """Stop every child, the highest tier first. Call :meth:`sweep` once NATS is stopped too.

        ``hurry()`` turning true (a second Ctrl-C) cuts every remaining grace short.
        """
        self.note_descendants()
        for tier in sorted({c.spec.tier for c in self.children}, reverse=True):
            group = [c for c in reversed(self.children) if c.spec.tier == tier]
            stop_groups(
                [
                    Group(c.pgid, c.spec.grace_s, c.spec.name, partial(c.proc.wait, 5))
                    for c in group
                    if c.alive() or group_members(c.pgid)
                ],
                hurry=hurry,
                overdue=self._overdue,
            )

    def _overdue(self, g: Group) -> None:
        self.say(f"{g.name} did not stop within {g.grace_s:.0f}s: killing it")

    def sweep(self) -> list[str]:
        """SIGKILL any process of this run still alive (NATS included: stop it first).

        Returns what it killed, as ``"pid command"``, so that `llmgw up` can say which service
        failed to clean up after itself.
        """
        pids = set(run_processes(self.run_token, self.layout.data_dir))
        for c in self.children:
            pids.update(c.descendants)
        procs = []
        for pid in pids - {os.getpid()}:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    procs.append((p, " ".join(p.cmdline()[:6])))
        for g in self.pgids:
            signal_group(g, signal.SIGKILL)
        killed = []
        for p, cmd in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
                killed.append(f"{p.pid} {cmd}")
        return killed


def is_run_entry_point(argv: list[str]) -> bool:
    """A nats-server or an llmgw command: the only kinds the run starts that name the data dir.

    Judged by the shape of the command, never by a substring of a path: a clone named ``llmgw`` runs
    every python of its venv as ``…/llmgw/.venv/bin/python``, a user's scripts included. The shapes:
    ``nats-server …`` (:class:`NatsServer`), ``python -m llmgw_cli …`` (:func:`child_argv`, the agents'
    engines) and the ``llmgw`` console script (``llmgw …``, run by its shebang as ``python …/llmgw …``).
    """
    if not argv:
        return False
    name = os.path.basename(argv[0])
    if name in ("nats-server", "llmgw"):
        return True
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] == "llmgw_cli":
        return True
    return len(argv) >= 2 and name.startswith("python") and os.path.basename(argv[1]) == "llmgw"


def run_processes(run_token: str, data_dir: Path | None = None) -> list[int]:
    """Pids of live processes of a run: carrying its marker, or a nats-server or llmgw naming its data dir.

    Anything else naming the data dir (a ``tail -f`` of a log, the shell that started `up`) is spared.
    """
    me = psutil.Process()
    spared = {me.pid, *(a.pid for a in me.parents())}
    needle = str(data_dir.resolve()) if data_dir is not None else None
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] in spared:
            continue
        try:
            argv = p.info["cmdline"] or []
            named = needle is not None and needle in " ".join(argv) and is_run_entry_point(argv)
            if (named or p.environ().get(RUN_MARKER) == run_token) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.info["pid"])
        except psutil.Error:
            continue
    return out


def write_state(path: Path, state: Mapping[str, object]) -> None:
    """Write ``state`` as JSON atomically (a reader never sees half a file), mode 0600: it holds the key."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)
