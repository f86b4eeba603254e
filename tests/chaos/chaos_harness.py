"""A cluster of real llmgw processes that the chaos tests (and ``bench/failover.py``) may kill.

Unlike the shared e2e ``llmgw up``, every part here is its own process that a test can SIGKILL,
SIGSTOP, or restart on its own: a nats-server with a data directory (stopped and started on the same
port), control planes, routers and agents with simulated GPUs whose engines are simulators.
Each child is ``python -m llmgw_cli <command>`` in its own process group. A per-cluster marker in
every child's environment (inherited by engines) lets :meth:`ChaosCluster.close` find and end any
process of the cluster, engines included, whatever a test killed or left stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from llmgw_runtime.natsserver import NatsServer, ensure_on_path
from tests.chaos.chaos_waits import mint_key, wait_endpoints
from tests.http_clients import async_client
from tests.kit.poll import eventually, eventually_sync
from tests.kit.ports import free_port

MARKER = "LLMGW_CHAOS_RUN"

# Aggressive timeouts: a lost node is rebuilt within seconds, a standby takes over within seconds.
AGGRESSIVE: dict[str, str] = {
    "LLMGW_HEARTBEAT_INTERVAL_S": "0.5",
    "LLMGW_NODE_LOST_S": "4",
    "LLMGW_LEASE_TTL_S": "3",
    "LLMGW_SETTLE_S": "2",
    "LLMGW_TICK_S": "0.25",
    "LLMGW_STOP_GRACE_S": "2",
}

# One model on H100 nodes, two replicas (so one node's loss leaves one serving while it is rebuilt),
# fast simulated engines; and a CPU model for variety of placement.
CATALOG = """\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 2
    startup_timeout_s: 30
    options: {startup_s: 0.3, ttft_ms: 15, tokens_per_s: 300, slots: 64}
"""

# For tests that must catch streams mid-flight on a node they break: at 60 tokens/s a 200-token stream
# lasts over 3 s on the engine. At 300 tokens/s (0.7 s) a loaded CI box (the test's own loop stalled
# 1.4-1.6 s) let the victim finish every stream it was running before the kill or freeze landed: the
# bytes still reached the router and nothing was left to continue ("streams continued on another
# replica: 0" in three CI runs, node loss and node freeze).
STREAMING_TOKENS_PER_S = 60
STREAMING_CATALOG = CATALOG.replace("tokens_per_s: 300", f"tokens_per_s: {STREAMING_TOKENS_PER_S}")
assert STREAMING_CATALOG != CATALOG


@dataclass
class Proc:
    """One llmgw service process of the cluster."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    # Set for routers: where their OpenAI listener is, and their /metrics (0: not told).
    port: int = 0
    admin_port: int = 0

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} start {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process's group (its engines live in groups of their own)."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would, and reap it."""
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``grace``."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class ChaosCluster:
    root: Path
    prefix: str = "chaos"
    settings: dict[str, str] = field(default_factory=lambda: dict(AGGRESSIVE))
    catalog: str = CATALOG
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    nats: NatsServer | None = None
    nats_port: int = 0
    procs: dict[str, Proc] = field(default_factory=dict)

    # ------------------------------------------------------------ setup

    def __post_init__(self) -> None:
        ensure_on_path()
        self.root.mkdir(parents=True, exist_ok=True)
        self.catalog_path = self.root / "catalog.yaml"
        self.catalog_path.write_text(self.catalog)

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def start_nats(self) -> NatsServer:
        """Start (or restart, on the same port and data directory) the nats-server."""
        if not self.nats_port:
            self.nats_port = free_port()
        self.nats = NatsServer(self.root / "nats", port=self.nats_port)
        self.nats.start()
        return self.nats

    def stop_nats(self) -> None:
        if self.nats is not None:
            self.nats.stop()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(self.settings)
        env.update(extra or {})
        env["LLMGW_PREFIX"] = self.prefix
        env["LLMGW_NATS_URLS"] = self.nats_url
        env[MARKER] = self.token
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _proc(
        self, name: str, command: list[str], extra: dict[str, str], launcher: list[str] | None = None
    ) -> Proc:
        """``launcher``: what runs the llmgw command instead of ``python -m llmgw_cli`` (see faults.py)."""
        head = launcher or [sys.executable, "-m", "llmgw_cli"]
        argv = [*head, *command, "--nats", self.nats_url, "--prefix", self.prefix]
        old = self.procs.get(name)
        if old is not None and old.alive():
            raise RuntimeError(f"{name} is already running (pid {old.pid})")
        p = Proc(name, argv, self.env(extra), self.logs / f"{name}.log")
        self.procs[name] = p
        return p.start()

    def start_controlplane(
        self, name: str = "cp-a", extra: dict[str, str] | None = None, launcher: list[str] | None = None
    ) -> Proc:
        return self._proc(
            name,
            ["controlplane", "--catalog", str(self.catalog_path), "--admin-port", "0"],
            extra or {},
            launcher,
        )

    def start_router(
        self,
        name: str = "router",
        port: int | None = None,
        launcher: list[str] | None = None,
        admin_port: int = 0,
    ) -> Proc:
        """``admin_port``: where its /metrics is served (0: a free port nobody is told)."""
        old = self.procs.get(name)
        port = port or (old.port if old is not None and old.port else free_port())
        p = self._proc(
            name,
            ["router", "--port", str(port), "--admin-port", str(admin_port), "--router-id", name],
            {},
            launcher,
        )
        p.port = port
        p.admin_port = admin_port
        return p

    def start_agent(self, node: str, gpus: str = "8xH100-80GB") -> Proc:
        return self._proc(
            f"agent-{node}",
            [
                "agent", "--node", node, "--sim-gpus", gpus, "--simulate-engines",
                "--sim-memory-gb", "1024", "--state-dir", str(self.root / "agents" / node),
            ],
            {},
        )  # fmt: skip

    def router_url(self, name: str = "router") -> str:
        return f"http://127.0.0.1:{self.procs[name].port}"

    def wait_router(self, name: str = "router", timeout: float = 30.0) -> None:
        p = self.procs[name]

        def healthy() -> bool:
            if not p.alive():
                raise AssertionError(f"{name} exited:\n{p.tail()}")
            try:
                return httpx.get(self.router_url(name) + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            eventually_sync(healthy, timeout=timeout, every=0.1, what=f"{name} to answer /health")
        except AssertionError as e:
            if not p.alive():
                raise  # it exited: the message has its log already
            raise AssertionError(f"{e}\n{p.tail()}") from None

    async def wait_router_async(self, name: str = "router", timeout: float = 30.0) -> None:
        """:meth:`wait_router` for a test's loop: polls without blocking it."""
        p = self.procs[name]

        async def healthy() -> bool:
            if not p.alive():
                raise AssertionError(f"{name} exited:\n{p.tail()}")
            try:
                r = await http.get(self.router_url(name) + "/health")
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        async with async_client(timeout=1) as http:
            try:
                await eventually(healthy, timeout=timeout, every=0.1, what=f"{name} to answer /health")
            except AssertionError as e:
                if not p.alive():
                    raise
                raise AssertionError(f"{e}\n{p.tail()}") from None

    # ------------------------------------------------------------ inspection

    def members(self) -> list[psutil.Process]:
        """Every live process of this cluster (services and engines), by the marker in its environment."""
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get(MARKER) == self.token and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def engine_pids(self) -> set[int]:
        """PIDs of running sim engines of this cluster (their command line says sim-engine)."""
        pids = set()
        for p in self.members():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if "sim-engine" in p.cmdline():
                    pids.add(p.pid)
        return pids

    def diagnostics(self, lines: int = 25) -> str:
        parts = []
        for name, p in self.procs.items():
            rc = p.popen.poll() if p.popen else None
            parts.append(f"--- {name} (rc={rc}):\n{p.tail(lines)}")
        return "\n".join(parts)

    # ------------------------------------------------------------ teardown

    async def aclose(self) -> None:
        """:meth:`close` for a test's loop: its waits for processes run in a thread."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop everything: services by SIGTERM in reverse start order, then any leftover by SIGKILL."""
        for p in reversed(list(self.procs.values())):
            p.stop(grace=10.0)
        for _ in range(3):
            left = self.members()
            if not left:
                break
            for m in left:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    m.resume()
                    m.kill()
            psutil.wait_procs(left, timeout=3)
        self.stop_nats()


def boot(
    root: Path,
    *,
    nodes: tuple[str, ...] = ("n1", "n2", "n3"),
    controlplanes: tuple[str, ...] = ("cp-a",),
    routers: tuple[str, ...] = ("router",),
    settings: dict[str, str] | None = None,
    model: str = "chat",
    replicas: int = 2,
    timeout: float = 90.0,
    catalog: str = CATALOG,
) -> tuple[ChaosCluster, str]:
    """Start a whole cluster and wait until ``model`` has ``replicas`` endpoints; (cluster, API key)."""
    cluster = ChaosCluster(root, settings=dict(AGGRESSIVE if settings is None else settings), catalog=catalog)
    try:
        cluster.start_nats()
        for cp in controlplanes:
            cluster.start_controlplane(cp)
        for r in routers:
            cluster.start_router(r)
        for n in nodes:
            cluster.start_agent(n)
        key = mint_key(cluster)
        for r in routers:
            cluster.wait_router(r)
        wait_endpoints(cluster, model, replicas, timeout)
    except BaseException:
        cluster.close()
        raise
    return cluster, key
