"""A cluster of separate hosts on one machine, for cutting apart and joining again.

Eleven hosts, each a network namespace of :mod:`tests.partition.netns` on one bridge:

    nats1 nats2 nats3     the three nats-servers of ``deploy/nats`` (one JetStream cluster, R3)
    cp-a cp-b             two control planes (one leads)
    router-1 router-2     two routers, each listening on its host's address
    n1 n2 n3              three agents with one simulated H100 each, engines simulated
    notifier              the notifier, probing through router-1

The test process is the client and the webhook receiver, in the root namespace on the bridge's own
address. Every process gets the three servers' addresses; cutting a host from a server is a DROP rule.

The processes are those of :class:`tests.natscluster.natscluster_harness.Topology` (itself the chaos
harness's cluster): the same commands, started inside a namespace by prefixing ``ip netns exec``. The
nats-server configurations are the natscluster harness's, derived from the production files, with
each server's address put in place of the loopback. What is checked after a heal is read from the
bus and from the processes: :class:`Taps` mirrors the assignment and lease buckets into streams of
the test's own, so that every assignment ever stored can be checked for its fence; engines are found
by the cluster's marker and placed on a host by their network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import nats.errors
import nats.js.errors
import psutil
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig, StreamSource

from llmgw_common.codec import decode, encode
from llmgw_common.ctl import LeaseRecord
from llmgw_common.messages import Assignment, ClusterSettings, Event, Webhook
from llmgw_common.subjects import DESIRED_SETTINGS, Subjects
from llmgw_runtime import bus, natsserver
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_bus import BUS_ERRORS
from tests.chaos.chaos_harness import Proc
from tests.kit.poll import eventually
from tests.natscluster.natscluster_harness import DEPLOY, NatsCluster, Topology, _get_json, derive_config
from tests.partition.netns import Net

NATS_HOSTS = ("nats1", "nats2", "nats3")
NODES = ("n1", "n2", "n3")
CONTROLPLANES = ("cp-a", "cp-b")
ROUTERS = ("router-1", "router-2")
HOSTS = (*NATS_HOSTS, *CONTROLPLANES, *ROUTERS, *NODES, "notifier")
# Each host has its own port space: every server listens on the same ports on its own address.
CLIENT_PORT, MONITOR_PORT, CLUSTER_PORT, ROUTER_PORT = 4222, 8222, 6222, 8080

# Short timings so a case runs in seconds: a silent node is lost after 8 s (the promise checked after
# each heal, engines exactly as assigned within one node_lost_s, includes the agent's own reconnect,
# up to 5 s on a loaded 2-core machine), a lease lapses after 6 s (not the chaos tests' 3: a stream
# leader election after a server is cut takes seconds, and a leader that cannot renew through one must
# not be deposed by it). Events are not grouped (each transition is one delivery, so "exactly once" is
# countable), and deliveries retry fast.
SETTINGS: dict[str, str] = {
    "LLMGW_HEARTBEAT_INTERVAL_S": "0.5",
    "LLMGW_NODE_LOST_S": "8",
    "LLMGW_LEASE_TTL_S": "6",
    "LLMGW_SETTLE_S": "2",
    "LLMGW_TICK_S": "0.25",
    "LLMGW_STOP_GRACE_S": "2",
    "LLMGW_QUIESCE_S": "5",
    "LLMGW_GROUP_WINDOW_S": "0",
    "LLMGW_RETRY_BASE_S": "0.2",
    "LLMGW_RETRY_MAX_S": "1",
}
NODE_LOST_S = float(SETTINGS["LLMGW_NODE_LOST_S"])

# One model, two replicas on three one-GPU nodes: one node is always free to take a lost replica.
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

# What a cut nats-server is replaced with on the command line: the real binary, run in the namespace
# its config file's directory names. NatsServer runs ``<binary> -c <conf> ...``, so $2 is the config.
_WRAPPER = """#!/bin/sh
exec ip netns exec "$(cat "$(dirname "$2")/netns")" {real} "$@"
"""


@contextlib.contextmanager
def _servers_run_by(binary: str) -> Iterator[None]:
    """NatsServer finds its binary by name at each start; for these starts it is ``binary``.

    Not a mock: the wrapper execs the real nats-server, inside its host's namespace (NatsServer has no
    launcher of its own, and the file it lives in is not this suite's to change)."""
    real = natsserver.find_nats_server
    natsserver.find_nats_server = lambda: binary
    try:
        yield
    finally:
        natsserver.find_nats_server = real


@dataclass
class NetnsNatsCluster(NatsCluster):
    """The natscluster harness's three servers, each on its own host's address."""

    net: Net | None = None

    def __post_init__(self) -> None:
        assert self.net is not None
        self.ips = [self.net.hosts[h].ip for h in NATS_HOSTS]
        self.client_ports = [CLIENT_PORT] * 3
        self.monitor_ports = [MONITOR_PORT] * 3
        self.cluster_ports = [CLUSTER_PORT] * 3
        # derive_config puts loopback and distinct ports in; distinct placeholders make each route's
        # line findable, then every loopback address:port becomes a host's address.
        placeholder = [16001, 16002, 16003]
        for i in range(3):
            d = self.root / f"nats-{i + 1}"
            d.mkdir(parents=True, exist_ok=True)
            conf = derive_config(
                (DEPLOY / f"nats-{i + 1}.conf").read_text(),
                client_port=CLIENT_PORT,
                monitor_port=MONITOR_PORT,
                cluster_ports=placeholder,
                store=d / "jetstream",
                auth=False,
            )
            for j, p in enumerate(placeholder):
                conf = conf.replace(
                    f"nats-route://127.0.0.1:{p}", f"nats-route://{self.ips[j]}:{CLUSTER_PORT}"
                )
            conf = conf.replace(f"127.0.0.1:{placeholder[i]}", f"{self.ips[i]}:{CLUSTER_PORT}")
            conf = re.sub(r"127\.0\.0\.1:", f"{self.ips[i]}:", conf)
            assert "127.0.0.1" not in conf, conf
            (d / "nats.conf").write_text(conf)
            (d / "netns").write_text(self.net.hosts[NATS_HOSTS[i]].ns)
            self.servers.append(
                NatsServer(
                    d,
                    port=CLIENT_PORT,
                    host=self.ips[i],
                    config_file=str(d / "nats.conf"),
                    extra_args=["-m", str(MONITOR_PORT)],
                    log_file=self.root / "logs" / f"nats-{i + 1}.log",
                )
            )
            self.names.append(f"nats-{i + 1}")
        self.wrapper = self.root / "nats-server-in-netns"
        self.wrapper.write_text(_WRAPPER.format(real=natsserver.find_nats_server()))
        self.wrapper.chmod(self.wrapper.stat().st_mode | stat.S_IXUSR)

    @property
    def urls(self) -> list[str]:
        return [f"nats://{ip}:{CLIENT_PORT}" for ip in self.ips]

    def start(self, timeout: float = 60.0) -> None:
        with _servers_run_by(str(self.wrapper)):
            super().start(timeout)

    def jsz(self, i: int) -> dict[str, Any] | None:
        return _get_json(f"http://{self.ips[i]}:{MONITOR_PORT}/jsz")

    def healthy(self, i: int) -> bool:
        return _get_json(f"http://{self.ips[i]}:{MONITOR_PORT}/healthz?js-enabled-only=true") is not None


@dataclass
class PartitionTopology(Topology):
    """:class:`Topology` with every process on its own host (``ip netns exec``)."""

    net: Net | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.natscluster = NetnsNatsCluster(self.root, None, net=self.net)

    def host(self, proc_name: str) -> str:
        return proc_name.removeprefix("agent-")

    def ip(self, host: str) -> str:
        assert self.net is not None
        return self.net.hosts[host].ip

    def _proc(
        self, name: str, command: list[str], extra: dict[str, str], launcher: list[str] | None = None
    ) -> Proc:
        assert self.net is not None
        head = launcher or [sys.executable, "-m", "llmgw_cli"]
        if name.startswith("router"):
            extra = {**extra, "LLMGW_HOST": self.ip(name)}
        return super()._proc(name, command, extra, [*self.net.exec_prefix(self.host(name)), *head])

    def router_url(self, name: str = "router-1") -> str:
        return f"http://{self.ip(name)}:{ROUTER_PORT}"

    def start_agent(self, node: str, gpus: str = "1xH100-80GB") -> Proc:
        return self._proc(
            f"agent-{node}",
            [
                "agent", "--node", node, "--address", self.ip(node), "--sim-gpus", gpus,
                "--simulate-engines", "--sim-memory-gb", "1024",
                "--state-dir", str(self.root / "agents" / node),
            ],
            {},
        )  # fmt: skip

    # ------------------------------------------------------------ engines

    def engines(self) -> set[tuple[str, int]]:
        """(host, port) of every running sim engine of this cluster, placed by its network namespace."""
        assert self.net is not None
        out: set[tuple[str, int]] = set()
        for p in self.members():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                argv = p.cmdline()
                if "sim-engine" not in argv or "--port" not in argv:
                    continue
                host = self.net.host_of_pid(p.pid)
                out.add((host or "?", int(argv[argv.index("--port") + 1])))
        return out

    def stop_quietly(self) -> None:
        """Close from a fixture's finalizer: a failure to stop one process must not keep the network
        teardown that follows from running (ChaosCluster.close already SIGKILLs what is left)."""
        with contextlib.suppress(Exception):
            self.close()


class Hooks:
    """The webhook receiver: answers 200 to every POST and keeps each event it was given (a group's
    members one by one), with when it arrived."""

    def __init__(self, host: str) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []
        self.posts = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                payload = json.loads(body)
                events = payload["events"] if payload.get("grouped") else [payload]
                with outer._lock:
                    outer.posts += 1
                    outer.got.extend((time.monotonic(), e) for e in events)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def transitions(self, subject: str, since: float = 0.0) -> list[str]:
        """The node.lost / node.recovered kinds delivered about ``subject``, in order, one per event id."""
        seen: set[str] = set()
        out = []
        with self._lock:
            for t, e in self.got:
                if t >= since and e["subject"] == subject and e["kind"] in ("node.lost", "node.recovered"):
                    if e["id"] not in seen:
                        seen.add(e["id"])
                        out.append(e["kind"])
        return out

    def duplicates(self, since: float = 0.0) -> int:
        with self._lock:
            ids = [e["id"] for t, e in self.got if t >= since]
        return len(ids) - len(set(ids))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


TAP_ASSIGN, TAP_LEADER = "PTAP_ASSIGN", "PTAP_LEADER"


@dataclass
class FenceCheck:
    """What the assignment and lease history say about fences."""

    writes: int
    fences: list[int]
    holders: list[str]
    regressions: list[str] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)

    def line(self) -> str:
        takeovers = sum(1 for a, b in zip(self.holders, self.holders[1:], strict=False) if a != b)
        return (
            f"{self.writes} assignment writes under fences {min(self.fences, default=0)}.."
            f"{max(self.fences, default=0)}, {len(self.holders)} lease writes, {takeovers} change(s) of holder, "
            f"{len(self.unknown)} fence(s) not among the lease revisions the tap kept"
        )


async def connect(topo: PartitionTopology, name: str = "partition-test") -> NATS:
    return await bus.connect(BusSettings(**topo.bus_settings("admin")), name)


async def make_taps(nc: NATS, prefix: str) -> None:
    """Mirror the assignment and lease buckets into streams that keep every message (the buckets keep
    one per key), so that each assignment ever stored can be checked for its fence after the fact."""
    js = nc.jetstream()
    s = Subjects(prefix)
    for name, bucket in ((TAP_ASSIGN, s.bucket_assign), (TAP_LEADER, s.bucket_leader)):
        with contextlib.suppress(nats.js.errors.BadRequestError):
            await js.add_stream(
                StreamConfig(name=name, mirror=StreamSource(name=f"KV_{bucket}"), num_replicas=3)
            )


async def _messages(nc: NATS, stream: str) -> list[tuple[int, str, bytes]]:
    js = nc.jetstream()
    info = await js.stream_info(stream)
    out = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            m = await js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            continue
        if m.data and not (m.headers or {}).get("KV-Operation"):
            out.append((seq, m.subject or "", m.data))
    return out


async def fence_check(nc: NATS) -> FenceCheck:
    """Every stored assignment's fence, in the order they were stored: none may be older than one stored
    before it (a deposed leader writing after its successor), and each must be a lease revision."""
    assigns = await _messages(nc, TAP_ASSIGN)
    leases = await _messages(nc, TAP_LEADER)
    holders = [decode(data, LeaseRecord).holder for _, _, data in leases]
    lease_seqs = {seq for seq, _, _ in leases}
    fences: list[int] = []
    check = FenceCheck(len(assigns), fences, holders)
    top = 0
    for seq, subject, data in assigns:
        a = decode(data, Assignment)
        fences.append(a.fence)
        if a.fence < top:
            check.regressions.append(f"seq {seq} {subject}: fence {a.fence} after {top}")
        top = max(top, a.fence)
        if lease_seqs and a.fence not in lease_seqs and a.fence >= min(lease_seqs):
            check.unknown.append(a.fence)
    return check


async def assigned(nc: NATS, prefix: str) -> set[tuple[str, int]]:
    """(node, port) of every shard the assignment bucket names."""
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_assign)
    out: set[tuple[str, int]] = set()
    for k in await bus.kv_keys(kv):
        a, _ = await bus.kv_get(kv, k, Assignment)
        if a is not None:
            out.update((a.node, s.port) for s in a.shards)
    return out


async def set_webhook(nc: NATS, prefix: str, url: str) -> None:
    kv = await nc.jetstream().key_value(Subjects(prefix).bucket_desired)
    await kv.put(DESIRED_SETTINGS, encode(ClusterSettings(webhooks=(Webhook(url=url, format="json"),))))


async def converged(topo: PartitionTopology, nc: NATS, want: int, timeout: float) -> float:
    """Seconds until the engines running are exactly those assigned, ``want`` of them; fails otherwise."""
    t0 = time.monotonic()
    last: tuple[set[tuple[str, int]], set[tuple[str, int]]] = (set(), set())

    async def same() -> bool:
        nonlocal last
        eng = await asyncio.to_thread(topo.engines)
        names = await assigned(nc, topo.prefix)
        last = (eng, names)
        return eng == names and len(eng) == want

    try:
        await eventually(
            same, timeout=timeout, every=0.25, what=f"{want} engines, each assigned", tolerate=BUS_ERRORS
        )
    except AssertionError as e:
        per_server = await assignments_per_server(topo)
        raise AssertionError(
            f"{e}: running {sorted(last[0])}, assigned {sorted(last[1])}; "
            f"the assignments as each server answers a get: {per_server}"
        ) from None
    return time.monotonic() - t0


async def assignments_per_server(topo: PartitionTopology) -> dict[str, dict[str, str]]:
    """Per nats host, what a client connected to it alone reads for each assignment key (revision and
    ports): a server whose replica lags answers gets from its own copy (the buckets are direct)."""
    assert isinstance(topo.natscluster, NetnsNatsCluster)
    out: dict[str, dict[str, str]] = {}
    for host, url in zip(NATS_HOSTS, topo.natscluster.urls, strict=True):
        view: dict[str, str] = {}
        try:
            nc = await bus.connect(
                BusSettings(nats_urls=[url], prefix=topo.prefix, kv_replicas=3),
                f"partition-diag-{host}",
                wait=False,
            )
        except (nats.errors.Error, OSError) as e:
            out[host] = {"error": str(e)}
            continue
        try:
            kv = await nc.jetstream().key_value(Subjects(topo.prefix).bucket_assign)
            for k in await bus.kv_keys(kv):
                a, rev = await bus.kv_get(kv, k, Assignment)
                view[k] = f"rev {rev} ports {[sh.port for sh in a.shards] if a else None}"
        except BUS_ERRORS as e:
            view["error"] = str(e)
        finally:
            await nc.close()
        out[host] = view
    return out


def wait_buckets(topo: PartitionTopology) -> None:
    async def made() -> bool:
        nc = await connect(topo)
        try:
            await nc.jetstream().stream_info(f"KV_{Subjects(topo.prefix).bucket_leader}")
            await nc.jetstream().stream_info(f"KV_{Subjects(topo.prefix).bucket_assign}")
            return True
        except nats.js.errors.NotFoundError:
            return False
        finally:
            await nc.close()

    asyncio.run(
        eventually(
            made,
            timeout=60,
            every=0.3,
            what="the control plane to make the buckets",
            tolerate=(*BUS_ERRORS, nats.errors.Error),
        )
    )


def clients_of(topo: PartitionTopology) -> dict[str, list[str]]:
    """Per nats host, the hosts whose processes are connected to it now (from its /connz)."""
    assert topo.net is not None and isinstance(topo.natscluster, NetnsNatsCluster)
    by_ip = {h.ip: h.name for h in topo.net.hosts.values()}
    out: dict[str, list[str]] = {}
    for i, name in enumerate(NATS_HOSTS):
        info = _get_json(f"http://{topo.natscluster.ips[i]}:{MONITOR_PORT}/connz?limit=1000") or {}
        out[name] = sorted(by_ip.get(c.get("ip", ""), "test") for c in info.get("connections") or [])
    return out


def holder_proc(topo: PartitionTopology, holder: str) -> str | None:
    """The control plane process whose lease holder name this is (``<hostname>-<pid>``)."""
    for name in CONTROLPLANES:
        p = topo.procs.get(name)
        if p is not None and p.alive() and holder.endswith(f"-{p.pid}"):
            return name
    return None


async def node_events(nc: NATS, prefix: str, node: str, since_wall: float) -> list[str]:
    """The node.lost / node.recovered kinds about ``node`` stored in the events stream since then."""
    js = nc.jetstream()
    s = Subjects(prefix)
    info = await js.stream_info(s.events_stream)
    out = []
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            raw = await js.get_msg(s.events_stream, seq)
        except nats.js.errors.NotFoundError:
            continue
        if not raw.data:
            continue
        ev = decode(raw.data, Event)
        if ev.subject == node and ev.kind in ("node.lost", "node.recovered") and ev.time >= since_wall:
            out.append(ev.kind)
    return out


async def get_timeouts(topo: PartitionTopology, servers: list[str], n: int = 12) -> dict[str, int]:
    """From a client of ``servers``, ``n`` reads of one assignment key each way: a direct get (what
    ``kv.get`` does on these buckets: any replica may answer) and a get through the stream's leader;
    how many of each timed out (1 s), and how many JetStream refused with 503 (a stream electing its
    leader right after the cut: a figure too, never the test's failure). A replica on a server cut from
    its peers still holds its direct get subscription in their interest graph until the route between
    them is noticed dead."""
    assert isinstance(topo.natscluster, NetnsNatsCluster)
    urls = [topo.natscluster.urls[NATS_HOSTS.index(s)] for s in servers]
    nc = await bus.connect(BusSettings(nats_urls=urls, prefix=topo.prefix), "partition-gets", wait=False)
    stream = f"KV_{Subjects(topo.prefix).bucket_assign}"
    subject = f"$KV.{Subjects(topo.prefix).bucket_assign}.{NODES[0]}"
    out = {"direct": 0, "leader": 0, "direct_503": 0, "leader_503": 0, "n": n}
    try:
        js = nc.jetstream(timeout=1.0)
        for _ in range(n):
            for way, direct in (("direct", True), ("leader", False)):
                try:
                    await js.get_msg(stream, subject=subject, direct=direct)
                except (TimeoutError, nats.errors.TimeoutError):
                    out[way] += 1
                except nats.js.errors.ServiceUnavailableError:
                    out[f"{way}_503"] += 1
                except nats.js.errors.NotFoundError:
                    pass
    finally:
        await nc.close()
    return out
