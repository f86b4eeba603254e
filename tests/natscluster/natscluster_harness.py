"""Three local nats-servers as one JetStream cluster, and the llmgw services on top of them.

The server configurations are derived from the production files ``deploy/nats/nats-{1,2,3}.conf``:
the same blocks, with loopback ports, a temporary store and, optionally, the per-role authorization
block of ``llmgw_common.natsauth`` in the ``auth.conf`` the production file includes (without
authorization, the include is commented out).
A substitution that finds nothing to replace fails loudly, so the deploy files and this test cannot
drift apart unnoticed.

:class:`Topology` is the chaos harness's :class:`ChaosCluster` (every service a killable process in its
own group) pointed at the three servers: every service gets all three URLs, ``LLMGW_KV_REPLICAS=3``
and, with authorization, the credentials of its role.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw_common.natsauth import Role, all_roles, authorization_config
from llmgw_common.subjects import Subjects
from llmgw_runtime.natsserver import NatsServer
from tests.chaos.chaos_harness import ChaosCluster, Proc
from tests.kit.poll import eventually_sync
from tests.kit.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "nats"


def _sub(text: str, pattern: str, repl: str, what: str) -> str:
    out, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
    if n == 0:
        raise AssertionError(f"deploy/nats config no longer has {what} (pattern {pattern!r})")
    return out


def derive_config(
    production: str, *, client_port: int, monitor_port: int, cluster_ports: list[int], store: Path, auth: bool
) -> str:
    """A production server config made local: loopback ports, ``store`` for JetStream, auth included."""
    text = _sub(production, r"^listen: .*$", f"listen: 127.0.0.1:{client_port}", "a client listen line")
    text = _sub(text, r"^http: .*$", f"http: 127.0.0.1:{monitor_port}", "a monitoring http line")
    # NatsServer passes the store as -sd, and nats-server refuses a store_dir given twice.
    text = _sub(text, r"^(\s*)store_dir: .*$", rf"\g<1># store_dir: {store} (given as -sd)", "a store_dir")
    text = _sub(text, r"^(\s*)max_file_store: .*$", r"\g<1>max_file_store: 1G", "a max_file_store")
    named = re.search(r"^server_name: nats-(\d)", text, re.M)
    assert named is not None, "the production config names its server nats-N"
    me = cluster_ports[int(named.group(1)) - 1]
    text = _sub(text, r"^(\s+)listen: 0\.0\.0\.0:6222$", rf"\g<1>listen: 127.0.0.1:{me}", "a cluster listen")
    for i, port in enumerate(cluster_ports, start=1):
        text = _sub(
            text,
            rf"nats-route://nats-{i}\.example\.internal:6222",
            f"nats-route://127.0.0.1:{port}",
            f"a route to nats-{i}",
        )
    # The production files require the generated authorization; a cluster without it drops the include.
    text = _sub(
        text,
        r"^include \./auth\.conf$",
        "include ./auth.conf" if auth else "# include ./auth.conf (a test cluster without users)",
        "the auth.conf include",
    )
    return text


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class NatsCluster:
    """Three nats-servers routed to each other, JetStream clustered."""

    root: Path
    auth_roles: list[Role] | None = None
    servers: list[NatsServer] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client_ports = [free_port() for _ in range(3)]
        self.monitor_ports = [free_port() for _ in range(3)]
        self.cluster_ports = [free_port() for _ in range(3)]
        for i in range(3):
            d = self.root / f"nats-{i + 1}"
            d.mkdir(parents=True, exist_ok=True)
            conf = derive_config(
                (DEPLOY / f"nats-{i + 1}.conf").read_text(),
                client_port=self.client_ports[i],
                monitor_port=self.monitor_ports[i],
                cluster_ports=self.cluster_ports,
                store=d / "jetstream",
                auth=self.auth_roles is not None,
            )
            if self.auth_roles is not None:
                (d / "auth.conf").write_text(authorization_config(self.auth_roles))
            (d / "nats.conf").write_text(conf)
            # NatsServer's own flags (-a, -p, -sd) say the same as the file; -m -1 would override the
            # file's monitoring port, so the file's port is passed again.
            self.servers.append(
                NatsServer(
                    d,
                    port=self.client_ports[i],
                    config_file=str(d / "nats.conf"),
                    extra_args=["-m", str(self.monitor_ports[i])],
                    log_file=self.root / "logs" / f"nats-{i + 1}.log",
                )
            )
            self.names.append(f"nats-{i + 1}")

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.client_ports]

    def start(self, timeout: float = 30.0) -> None:
        """Start all three at once: a clustered server is healthy only once a meta leader exists."""
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for f in [pool.submit(s.start, timeout) for s in self.servers]:
                f.result()

    def alive(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if s.proc is not None and s.proc.poll() is None]

    def jsz(self, i: int) -> dict[str, Any] | None:
        return _get_json(f"http://127.0.0.1:{self.monitor_ports[i]}/jsz")

    def healthy(self, i: int) -> bool:
        try:
            url = f"http://127.0.0.1:{self.monitor_ports[i]}/healthz?js-enabled-only=true"
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def meta_leader(self) -> str | None:
        """The meta leader's server name when every live server names the same one, else None."""
        leaders = set()
        for i in self.alive():
            info = self.jsz(i)
            leader = ((info or {}).get("meta_cluster") or {}).get("leader")
            if not leader or not self.healthy(i):
                return None
            leaders.add(leader)
        return leaders.pop() if len(leaders) == 1 else None

    def wait_meta_leader(self, timeout: float = 30.0) -> tuple[str, float]:
        """The JetStream meta leader every live server agrees on, and the seconds it took."""
        t0 = time.monotonic()
        try:
            leader = eventually_sync(
                self.meta_leader, timeout=timeout, every=0.1, what="every live server to name one meta leader"
            )
        except AssertionError as e:
            raise AssertionError(f"{e}: {self.logs_tail()}") from None
        assert leader is not None
        return leader, time.monotonic() - t0

    def index(self, name: str) -> int:
        return self.names.index(name)

    def kill(self, i: int) -> None:
        self.servers[i].kill()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for s in self.servers:
            try:
                text = s.log_file.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                text = []
            out.append(f"--- {s.log_file.name}\n" + "\n".join(text))
        return "\n".join(out)


def role_of(proc_name: str) -> str:
    """The NATS user a cluster process runs as (the names of ``llmgw_common.natsauth.all_roles``)."""
    if proc_name.startswith("cp-"):
        return "controlplane"
    if proc_name.startswith("router"):
        return "router"
    if proc_name.startswith("agent-"):
        return proc_name
    # The notifier runs as admin: under its generated role it cannot start (ensure_all reads every
    # bucket's stream info, which the notifier role does not grant).
    return "admin"


@dataclass
class Topology(ChaosCluster):
    """The chaos harness's cluster of processes, on a :class:`NatsCluster` with R3 buckets."""

    auth: bool = False
    nodes: tuple[str, ...] = ("n1", "n2")
    natscluster: NatsCluster | None = None
    roles: dict[str, Role] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.settings["LLMGW_KV_REPLICAS"] = "3"
        if self.auth:
            self.roles = {r.user: r for r in all_roles(Subjects(self.prefix), list(self.nodes))}
        self.natscluster = NatsCluster(self.root, list(self.roles.values()) if self.auth else None)

    @property
    def nats_urls(self) -> list[str]:
        assert self.natscluster is not None
        return self.natscluster.urls

    @property
    def nats_url(self) -> str:  # what ChaosCluster passes to --nats and LLMGW_NATS_URLS: all three
        return ",".join(self.nats_urls)

    def start_nats(self) -> NatsServer:
        assert self.natscluster is not None
        self.natscluster.start()
        return self.natscluster.servers[0]

    def stop_nats(self) -> None:
        if self.natscluster is not None:
            self.natscluster.stop()

    def role_env(self, role: str) -> dict[str, str]:
        """LLMGW_* credentials of ``role`` (nothing without authorization)."""
        r = self.roles.get(role)
        if r is None:
            return {}
        return {
            "LLMGW_NATS_USER": r.user,
            "LLMGW_NATS_PASSWORD": r.password,
            "LLMGW_NATS_INBOX_PREFIX": r.inbox_prefix,
        }

    def _proc(
        self, name: str, command: list[str], extra: dict[str, str], launcher: list[str] | None = None
    ) -> Proc:
        return super()._proc(name, command, {**extra, **self.role_env(role_of(name))}, launcher)

    def start_notifier(self, probe_key: str, router: str = "router") -> Proc:
        # The probe key travels in the environment: the harness writes each argv into the log.
        return self._proc(
            "notifier",
            ["notifier", "--router-url", self.router_url(router)],
            {"LLMGW_PROBE_KEY": probe_key, "LLMGW_RETRY_BASE_S": "0.2", "LLMGW_RETRY_MAX_S": "1"},
        )

    def cli(self, name: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``llmgw <args>`` as the admin role; its stderr is kept under logs/ as ``cli-<name>.err``."""
        env = self.env(self.role_env("admin"))
        r = subprocess.run(
            [sys.executable, "-m", "llmgw_cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"cli-{name}.err", "a") as f:
            f.write(r.stderr)
        return r

    def bus_settings(self, role: str = "admin") -> dict[str, Any]:
        """Keyword arguments of a BusSettings for a test's own client."""
        out: dict[str, Any] = {"nats_urls": self.nats_urls, "prefix": self.prefix, "kv_replicas": 3}
        r = self.roles.get(role)
        if r is not None:
            out.update(nats_user=r.user, nats_password=r.password, nats_inbox_prefix=r.inbox_prefix)
        return out


def service_logs(root: Path) -> list[Path]:
    """Every log file of a run: each process's own log, the nats-servers', the engines' (agents' state)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        if "jetstream" in Path(dirpath).parts:
            continue  # the servers' stores hold the buckets' data (key hashes, webhooks) by design
        for f in files:
            if f.endswith((".log", ".err", ".out")):
                out.append(Path(dirpath) / f)
    return sorted(out)
