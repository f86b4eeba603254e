"""Fleet scale (issue 35): the whole system against a simulated fleet, measured per component.

Real parts: a NATS cluster of 3 servers (``tests/natscluster``'s ``NatsCluster``, from the production
configs: 1 MB ``max_payload``, buckets at R3), two control planes (``llmgw controlplane``, one leads),
and R routers (``llmgw router``). Simulated: N nodes of 8 GPUs, whose agents' messages this process
generates as agents send them (inventory once, heartbeats every 2 s, a load line per ready replica once
a heartbeat as the agent's load feed sends an unchanged load (nothing from a node without one), an empty
KV-event batch every 5 s, answers to routers' KV snapshot requests), reading each node's assignment from
``<prefix>_assign`` and reporting its shards ready; M models and R replicas in the catalog; K API keys.

It measures, in a steady window: CPU (% of one core) and RSS of every process; bus messages and bytes per
second by subject (a ``>`` subscriber, names folded: ``<node>``, ``<router>``, ``<key>``) and the largest
message seen per subject; JetStream storage per stream; the leader's reconcile pass p50/p99 (its own
``debug.stats``). Then a client at a stated rate through the routers, and churn, each change timed until
every router acts on it: a key revoked (every router answers 401), a key created (no router answers
401), a node lost (its endpoints gone from every router's table, seen on the routers' admin
``/routing``), a model scaled up by a catalog change (its new replica in every router's table).

    .venv/bin/python bench/fleet_scale.py --size hundredth      # 500 nodes, 50 models, 200 replicas, 1,000 keys, 2 routers
    .venv/bin/python bench/fleet_scale.py --size tenth          # 5,000 / 500 / 2,000 / 10,000 / 2 routers
    .venv/bin/python bench/fleet_scale.py --size full           # 50,000 / 5,000 / 20,000 / 100,000 / 20 routers
    .venv/bin/python bench/fleet_scale.py --nodes 2000 --models 200 --replicas 800 --keys 4000 --routers 4

``--json FILE`` writes every figure. The client's endpoints are the simulated nodes' addresses, where
nothing listens: an answer is the router's own (a 502 after its retries), so the client measures the
router's path up to the engine (auth, admission, pick, connect), not an engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import psutil
import yaml
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

# The test kit's free port and three-server cluster.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kit.ports import free_port
from tests.natscluster.natscluster_harness import NatsCluster

from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.kvcache import KvDeltas, KvSnapshot
from llmgw_common.messages import (
    ApiKeyRecord,
    Assignment,
    GpuInfo,
    Heartbeat,
    Inventory,
    LoadReport,
    ReplicaLoad,
    ShardReport,
    ShardState,
)
from llmgw_common.routing_table import ModelRouting, row_key
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import INDEXED_MARK, create_key, name_key, revoke_key
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable
from llmgw_runtime.natsserver import ensure_on_path
from llmgw_runtime.runtime import cancel_and_wait

PREFIX = "fleet"
HEARTBEAT_S = 2.0
KV_IDLE_S = 5.0
GPUS = 8
FABRICS = 4
# nodes, models, replicas, keys, routers
SIZES = {
    "full": (50_000, 5_000, 20_000, 100_000, 20),
    "tenth": (5_000, 500, 2_000, 10_000, 2),
    "hundredth": (500, 50, 200, 1_000, 2),
}


def catalog(models: int, replicas: int, bump: str | None = None) -> dict[str, object]:
    """``models`` GPU models of 1, 2, 4 and 8 cards sharing ``replicas`` replicas; ``bump`` gets one more."""
    per, extra = divmod(replicas, models)
    out = []
    for i in range(models):
        name = f"m{i:05d}"
        n = per + (1 if i < extra else 0) + (1 if name == bump else 0)
        out.append(
            {
                "name": name,
                "engine": "sim",
                "replicas": n,
                "gpu_class": "H100-80GB",
                "gpus_per_node": (1, 2, 4, 8)[i % 4],
            }
        )
    return {"models": out}


@dataclass
class Fleet:
    """N agents' messages, as agents send them, from one connection."""

    nc: NATS
    subjects: Subjects
    n: int
    boot: str = "boot-1"
    seq: int = 0
    kv_seq: int = 0
    shards: dict[str, tuple[ShardReport, ...]] = field(default_factory=dict)
    # Nodes whose agents are silent (lost): no heartbeat, no load, no KV batch.
    silent: set[str] = field(default_factory=set)
    published: int = 0
    # Which nodes send the empty KV batch every KV_IDLE_S: "replicas" (since issue 35's fix, only a node
    # holding a replica whose engine publishes KV events does: counted as if every replica's did, an
    # upper bound), "all" (every node, as before it), "none" (the sim engines here publish none).
    kv_idle_from: str = "replicas"

    def node(self, i: int) -> str:
        return f"n{i:05d}"

    @staticmethod
    def address(name: str) -> str:
        """A loopback address of its own per node: the control plane's engine ports are unique per address
        (20,000-29,999), and nothing listens there, so a router's connect is refused at once."""
        i = int(name[1:])
        return f"127.{1 + i // 65536}.{(i // 256) % 256}.{i % 256}"

    def inventory(self, i: int) -> bytes:
        name = self.node(i)
        gpus = tuple(
            GpuInfo(index=g, uuid=f"GPU-{name}-{g}", name="H100", gpu_class="H100-80GB", memory_mb=81559)
            for g in range(GPUS)
        )
        inv = Inventory(
            node=name,
            boot_id=self.boot,
            sent_at=time.time(),
            fabric=f"ib-{i % FABRICS}",
            address=self.address(name),
            memory_gb=1024.0,
            cpus=96,
            engines=("sim", "vllm", "llamacpp"),
            simulated=True,
            gpus=gpus,
        )
        return encode(inv)

    async def send_inventories(self) -> None:
        for i in range(self.n):
            await self.nc.publish(self.subjects.inventory(self.node(i)), self.inventory(i))
            if i % 500 == 499:
                await self.nc.flush()
        await self.nc.flush()

    async def on_assign(self, msg: Msg) -> None:
        try:
            a = decode(msg.data, Assignment)
        except DecodeError:
            return
        self.shards[a.node] = tuple(
            ShardReport(
                replica_id=s.replica_id, shard=s.shard, model=s.model, state=ShardState.READY, port=s.port
            )
            for s in a.shards
        )

    async def on_inventory_request(self, msg: Msg) -> None:
        """A control plane that holds no inventory of a node asks it (a standby started after it was sent)."""
        name = msg.subject.split(".")[-2]
        if name not in self.silent:
            await self.nc.publish(self.subjects.inventory(name), self.inventory(int(name[1:])))

    async def on_snapshot(self, msg: Msg) -> None:
        """A router's KV snapshot request: an agent's answer for a node whose engines publish no events."""
        node = msg.subject.split(".")[-2]
        await msg.respond(
            encode(KvSnapshot(node=node, stream=self.boot, seq=self.kv_seq, sent_at=time.time()))
        )

    def heartbeat(self, name: str) -> bytes:
        return encode(
            Heartbeat(
                node=name,
                boot_id=self.boot,
                seq=self.seq,
                sent_at=time.time(),
                address=self.address(name),
                shards=self.shards.get(name, ()),
            )
        )

    def load(self, name: str) -> bytes | None:
        """As the agent's load feed sends (issue 34): the lines due, none when the node has none; a
        load that does not change is due once a heartbeat."""
        reps = tuple(
            ReplicaLoad(replica_id=s.replica_id, shard=s.shard, running=1.0, waiting=0.0, kv_use=0.1)
            for s in self.shards.get(name, ())
            if s.shard == 0
        )
        if not reps:
            return None
        return encode(LoadReport(node=name, sent_at=time.time(), replicas=reps))

    def kv_idle(self, name: str) -> bytes | None:
        if self.kv_idle_from == "none" or (self.kv_idle_from == "replicas" and not self.shards.get(name)):
            return None
        return encode(KvDeltas(node=name, stream=self.boot, seq=self.kv_seq, sent_at=time.time()))

    async def every(self, interval: float, subject: Any, make: Any, slices: int = 20) -> None:
        """Every live node once per ``interval``, spread over ``slices`` sends so the rate is even."""
        per = max(1, -(-self.n // slices))
        while True:
            t0 = time.monotonic()
            if make == self.heartbeat:
                self.seq += 1
            if make == self.kv_idle:
                self.kv_seq += 1
            for k in range(0, self.n, per):
                for i in range(k, min(self.n, k + per)):
                    name = self.node(i)
                    if name in self.silent:
                        continue
                    data = make(name)
                    if data is None:
                        continue
                    await self.nc.publish(subject(name), data)
                    self.published += 1
                await self.nc.flush()
                target = t0 + interval * (k + per) / self.n
                await asyncio.sleep(max(0.0, target - time.monotonic()))

    def tasks(self) -> list[asyncio.Task[None]]:
        s = self.subjects
        return [
            asyncio.create_task(self.every(HEARTBEAT_S, s.heartbeat, self.heartbeat)),
            asyncio.create_task(self.every(HEARTBEAT_S, s.load, self.load)),
            asyncio.create_task(self.every(KV_IDLE_S, s.kv, self.kv_idle)),
        ]


_FOLD = [
    (re.compile(r"\.n\d{5}\."), ".<node>."),
    (re.compile(r"\.r\d+\."), ".<router>."),
    (re.compile(r"^\$KV\.([^.]+)\..*$"), r"$KV.\1.<key>"),
    (re.compile(r"^_INBOX\..*$"), "_INBOX.<reply>"),
    (re.compile(r"^(\$JS\.API\.[A-Z]+\.[A-Z]+)\..*$"), r"\1.<...>"),
    (re.compile(r"^(\$JS\.ACK)\..*$"), r"\1.<...>"),
    (re.compile(r"^(\$JS\.FC)\..*$"), r"\1.<...>"),
]


def fold(subject: str) -> str:
    for pat, rep in _FOLD:
        subject = pat.sub(rep, subject)
    return subject


@dataclass
class BusMeter:
    """Every message on the bus (one ``>`` subscriber): count, bytes and the largest, by folded subject."""

    msgs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    largest: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    async def on_msg(self, msg: Msg) -> None:
        f = fold(msg.subject)
        n = len(msg.data) + sum(len(k) + len(v) for k, v in (msg.headers or {}).items())
        self.msgs[f] += 1
        self.bytes[f] += n
        if n > self.largest[f]:
            self.largest[f] = n

    def reset(self) -> None:
        self.msgs.clear()
        self.bytes.clear()

    def rates(self, seconds: float) -> list[dict[str, Any]]:
        rows = [
            {
                "subject": s,
                "msgs_s": round(self.msgs[s] / seconds, 1),
                "bytes_s": round(self.bytes[s] / seconds),
                "largest": self.largest[s],
            }
            for s in self.msgs
        ]
        return sorted(rows, key=lambda r: -r["bytes_s"])


@dataclass
class Proc:
    name: str
    kind: str
    pid: int
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    admin: int = 0

    def cpu_s(self) -> float:
        try:
            t = psutil.Process(self.pid).cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return float(t.user + t.system)

    def rss_mb(self) -> float:
        try:
            return float(psutil.Process(self.pid).memory_info().rss) / 2**20
        except psutil.NoSuchProcess:
            return 0.0


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


async def _routing(s: aiohttp.ClientSession, r: Proc, model: str | None = None) -> dict[str, Any]:
    url = f"http://127.0.0.1:{r.admin}/routing" + (f"?model={model}" if model else "")
    async with s.get(url) as resp:
        data: dict[str, Any] = await resp.json(content_type=None)
        return data


async def _until(what: str, probe: Any, timeout: float, every: float = 0.02) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await probe():
            return time.monotonic() - t0
        await asyncio.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:g}s")


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.a = args
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cluster = NatsCluster(root / "nats")
        self.cps: list[Proc] = []
        self.routers: list[Proc] = []
        self.out: dict[str, Any] = {
            "size": {
                "nodes": args.nodes,
                "models": args.models,
                "replicas": args.replicas,
                "keys": args.keys,
                "routers": args.routers,
            }
        }

    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            LLMGW_LOG_LEVEL="WARNING",
            LLMGW_KV_REPLICAS="3",
            LLMGW_TICK_S="1",
            LLMGW_SETTLE_S="0",
            LLMGW_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_S),
            LLMGW_NODE_LOST_S=str(self.a.node_lost_s),
        )

    def start_cp(self, i: int, cat: Path) -> Proc:
        urls = ",".join(self.cluster.urls)
        argv = [sys.executable, "-m", "llmgw_cli", "controlplane", "--nats", urls, "--prefix", PREFIX]
        argv += ["--catalog", str(cat), "--admin-port", "0"]
        p = _spawn(argv, self.logs / f"cp{i}.log", self.env())
        return Proc(f"cp{i}", "controlplane", p.pid, p)

    def start_router(self, i: int) -> Proc:
        urls = ",".join(self.cluster.urls)
        port, admin = free_port(), free_port()
        argv = [sys.executable, "-m", "llmgw_cli", "router", "--nats", urls, "--prefix", PREFIX]
        argv += ["--port", str(port), "--router-id", f"r{i}", "--admin-port", str(admin)]
        p = _spawn(argv, self.logs / f"r{i}.log", self.env())
        return Proc(f"r{i}", "router", p.pid, p, port, admin)

    def all_procs(self) -> list[Proc]:
        out = list(self.cps) + list(self.routers)
        for i, srv in enumerate(self.cluster.servers):
            if srv.proc is not None:
                out.append(Proc(f"nats-{i + 1}", "nats-server", srv.proc.pid))
        out.append(Proc("fleet", "fleet + meter (this)", os.getpid()))
        return out

    async def window(self, seconds: float, meter: BusMeter) -> dict[str, Any]:
        procs = self.all_procs()
        c0 = {p.name: p.cpu_s() for p in procs}
        meter.reset()
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        dt = time.monotonic() - t0
        rows = {
            p.name: {
                "kind": p.kind,
                "cpu_pct": round((p.cpu_s() - c0[p.name]) / dt * 100, 1),
                "rss_mb": round(p.rss_mb()),
            }
            for p in procs
        }
        rates = meter.rates(dt)
        return {
            "seconds": round(dt, 1),
            "procs": rows,
            "bus": rates,
            "bus_msgs_s": round(sum(r["msgs_s"] for r in rates)),
            "bus_bytes_s": round(sum(r["bytes_s"] for r in rates)),
        }

    async def run(self) -> dict[str, Any]:
        a = self.a
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, _dump_tasks)
        t_start = time.monotonic()
        self.cluster.start()
        leader, took = self.cluster.wait_meta_leader()
        print(f"nats: 3 servers, meta leader {leader} after {took:.1f}s", file=sys.stderr, flush=True)
        nc = await nats.connect(self.cluster.urls, pending_size=256 * 1024 * 1024, max_reconnect_attempts=-1)
        meter_nc = await nats.connect(self.cluster.urls, pending_size=256 * 1024 * 1024)
        meter = BusMeter()
        await meter_nc.subscribe(
            ">", cb=meter.on_msg, pending_msgs_limit=2_000_000, pending_bytes_limit=2**30
        )
        subjects = Subjects(PREFIX)
        js = nc.jetstream()
        buckets = await bus.ensure_all(js, subjects, replicas=3)
        # K keys, as `llmgw keys create` stores them (records by raw publish: a put each takes minutes),
        # with their names' index (issue 35: a name is checked by one get, apikeys.py).
        await bus.ensure_kv(js, subjects.bucket_key_names, replicas=3)
        for i in range(a.keys):
            rec = ApiKeyRecord(id=f"k{i:06d}", name=f"key {i}", hash=f"{i:064x}", created=time.time())
            await nc.publish(f"$KV.{subjects.bucket_keys}.k{i:06d}", encode(rec))
            await nc.publish(f"$KV.{subjects.bucket_key_names}.{name_key(rec.name)}", rec.id.encode())
            if i % 1000 == 999:
                await nc.flush()
        await nc.publish(f"$KV.{subjects.bucket_key_names}.{INDEXED_MARK}", b"1")
        await nc.flush()
        client_key, _ = await create_key(nc, PREFIX, "client")
        cat = self.root / "catalog.yaml"
        cat.write_text(yaml.safe_dump(catalog(a.models, a.replicas)))
        self.cps = [self.start_cp(0, cat)]
        ctl = CtlClient(nc, PREFIX, timeout=20.0)
        await _until("a leading control plane", lambda: self._leads(ctl), 60, 0.2)
        self.cps.append(self.start_cp(1, cat))
        fleet = Fleet(nc, subjects, a.nodes, kv_idle_from=a.kv_idle_from)
        await nc.subscribe(f"$KV.{subjects.bucket_assign}.>", cb=fleet.on_assign)
        await nc.subscribe(f"{PREFIX}.node.*.kv-snapshot", cb=fleet.on_snapshot)
        await nc.subscribe(f"{PREFIX}.node.*.inventory-request", cb=fleet.on_inventory_request)
        t0 = time.monotonic()
        await fleet.send_inventories()
        beats = fleet.tasks()
        try:
            placed = await self._until_ready(ctl, a.place_timeout_s)
            self.out["place_all_s"] = round(time.monotonic() - t0, 1)
            self.out["placed"] = placed
            print(f"placed and ready: {placed} after {self.out['place_all_s']}s", file=sys.stderr, flush=True)
            self.routers = [self.start_router(i) for i in range(a.routers)]
            want = placed["ready"]
            async with aiohttp.ClientSession() as s:
                took_r = await _until(
                    "every router holding the table",
                    lambda: self._routers_hold(s, want),
                    a.place_timeout_s,
                    0.5,
                )
                self.out["routers_synced_s"] = round(took_r, 1)
                print(f"routers hold {want} endpoints after {took_r:.1f}s", file=sys.stderr, flush=True)
                await asyncio.sleep(a.settle_s)
                st0 = await ctl.debug_stats()
                self.out["steady"] = await self.window(a.window_s, meter)
                st1 = await ctl.debug_stats()
                self.out["passes"] = self._passes(st0, st1)
                self.out["jetstream"] = await self._storage(js, buckets)
                print(f"steady: {self._brief(self.out['steady'])}", file=sys.stderr, flush=True)
                if a.rate > 0:
                    client = asyncio.create_task(self._client(s, client_key, a.rate, a.window_s))
                    loaded = await self.window(a.window_s, meter)
                    loaded["client"] = await client
                    self.out["loaded"] = loaded
                    print(
                        f"loaded: {self._brief(loaded)} client {loaded['client']}",
                        file=sys.stderr,
                        flush=True,
                    )
                self.out["churn"] = await self._churn(s, nc, ctl, fleet, meter)
                st2 = await ctl.debug_stats()
                self.out["passes_with_churn"] = self._passes(st1, st2)
        finally:
            # Not one cancel: nats-py's flush can swallow it (see cancel_and_wait), and a gather waited for
            # ever after a run that was over.
            await cancel_and_wait(beats)
            await nc.close()
            await meter_nc.close()
        self.out["wall_s"] = round(time.monotonic() - t_start)
        return self.out

    @staticmethod
    def _brief(w: dict[str, Any]) -> str:
        procs = ", ".join(f"{n} {p['cpu_pct']}% {p['rss_mb']}MB" for n, p in w["procs"].items())
        return f"bus {w['bus_msgs_s']} msg/s {w['bus_bytes_s'] / 1e6:.2f} MB/s; {procs}"

    @staticmethod
    def _passes(a: Any, b: Any) -> dict[str, Any]:
        n = b.passes - a.passes
        window = sorted(b.recent_pass_ms[-n:]) if n > 0 else [b.last_pass_ms]
        return {
            "passes": n,
            "p50_ms": round(statistics.median(window), 1),
            "p99_ms": round(window[min(len(window) - 1, int(len(window) * 0.99))], 1),
            "max_ms": round(window[-1], 1),
            "cp_rss_mb": b.rss_mb,
        }

    async def _leads(self, ctl: CtlClient) -> bool:
        try:
            return bool((await ctl.debug_stats()).leader)
        except CtlUnavailable:
            return False

    async def _until_ready(self, ctl: CtlClient, timeout: float) -> dict[str, int]:
        t0, last, last_change, said = time.monotonic(), (-1, -1), time.monotonic(), 0.0
        while time.monotonic() - t0 < timeout:
            try:
                st = await asyncio.wait_for(ctl.debug_stats(), 30)
            except (CtlUnavailable, TimeoutError) as e:  # a leadership changing hands under load
                print(f"  debug.stats: {e}", file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)
                continue
            if time.monotonic() - said > 10:
                said = time.monotonic()
                print(
                    f"  {said - t0:.0f}s: nodes {st.nodes} placed {st.placed_replicas} ready {st.ready_replicas}"
                    f" of {st.desired_replicas}, pass p50 {st.pass_p50_ms:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
            now = (st.placed_replicas, st.ready_replicas)
            if now != last:
                last, last_change = now, time.monotonic()
            if st.ready_replicas >= st.desired_replicas > 0 or (
                st.ready_replicas and time.monotonic() - last_change > 10
            ):
                break
            await asyncio.sleep(0.5)
        return {
            "desired": st.desired_replicas,
            "placed": st.placed_replicas,
            "ready": st.ready_replicas,
            "unplaceable_models": st.unplaceable_models,
            "nodes": st.nodes,
        }

    async def _routers_hold(self, s: aiohttp.ClientSession, want: int) -> bool:
        try:
            got = [await _routing(s, r) for r in self.routers]
        except (aiohttp.ClientError, OSError):
            return False
        return all(g["endpoints"] >= want for g in got)

    async def _storage(self, js: Any, buckets: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in [*buckets, Subjects(PREFIX).events_stream]:
            stream = name if name == Subjects(PREFIX).events_stream else f"KV_{name}"
            try:
                info = await js.stream_info(stream)
            except nats.errors.Error:
                continue
            out[stream] = {"messages": info.state.messages, "bytes": info.state.bytes}
        jsz = self.cluster.jsz(0) or {}
        out["server_1_store_bytes"] = jsz.get("storage")
        return out

    async def _client(
        self, s: aiohttp.ClientSession, key: str, rate: float, seconds: float
    ) -> dict[str, Any]:
        codes: dict[int, int] = defaultdict(int)
        lat: list[float] = []
        rng = random.Random(1)
        hdrs = {"Authorization": f"Bearer {key}"}

        async def one(i: int) -> None:
            r = self.routers[i % len(self.routers)]
            body = {
                "model": f"m{rng.randrange(self.a.models):05d}",
                "messages": [{"role": "user", "content": "hi"}],
            }
            t = time.monotonic()
            try:
                async with s.post(
                    f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body, headers=hdrs
                ) as resp:
                    await resp.read()
                    codes[resp.status] += 1
            except (aiohttp.ClientError, OSError, TimeoutError):
                codes[0] += 1
            lat.append(time.monotonic() - t)

        tasks = []
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < seconds:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)
        lat.sort()
        return {
            "rate": rate,
            "sent": i,
            "codes": dict(codes),
            "p50_ms": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 1) if lat else None,
        }

    async def _status(self, s: aiohttp.ClientSession, r: Proc, key: str) -> int:
        # A model no catalog has: a key taken is answered 404 at once (after auth), a refused one 401;
        # a real model's request would be held for the engines that do not exist.
        body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        try:
            async with s.post(
                f"http://127.0.0.1:{r.port}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=aiohttp.ClientTimeout(total=0.5),
            ) as resp:
                return resp.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return 0

    async def _every_router(
        self, s: aiohttp.ClientSession, what: str, ok: Any, timeout: float
    ) -> dict[str, Any]:
        """Time until each router satisfies ``ok(router)``; the slowest is the change's figure."""
        t0 = time.monotonic()
        pending = {r.name: r for r in self.routers}
        took: dict[str, float] = {}
        while pending and time.monotonic() - t0 < timeout:
            for name, r in list(pending.items()):
                if await ok(r):
                    took[name] = time.monotonic() - t0
                    del pending[name]
            await asyncio.sleep(0.01)
        return {
            "what": what,
            "all_s": round(max(took.values()), 3) if took and not pending else None,
            "missing": sorted(pending),
            "per_router_s": {k: round(v, 3) for k, v in took.items()},
        }

    async def _churn(
        self, s: aiohttp.ClientSession, nc: NATS, ctl: CtlClient, fleet: Fleet, meter: BusMeter
    ) -> dict[str, Any]:
        a = self.a
        out: dict[str, Any] = {}
        meter.reset()
        t_churn = time.monotonic()
        # A key revoked: every router answers 401 for it.
        key, _ = await create_key(nc, PREFIX, "churn-revoked")
        await self._every_router(s, "warm", lambda r: self._status_not(s, r, key, 401), 10)
        await revoke_key(nc, PREFIX, "churn-revoked")
        out["key_revoked"] = await self._every_router(
            s, "revoked key refused", lambda r: self._status_is(s, r, key, 401), 10
        )
        # A key created: no router refuses it.
        t = time.monotonic()
        new, _ = await create_key(nc, PREFIX, "churn-created")
        out["key_created"] = await self._every_router(
            s, "new key taken", lambda r: self._status_not(s, r, new, 401), 10
        )
        out["key_created"]["including_write_s"] = round(time.monotonic() - t, 3)
        # A node lost: its endpoints gone from every router (from its last message).
        victim, models = self._victim(fleet)
        fleet.silent.add(victim)
        routing = await nc.jetstream().key_value(Subjects(PREFIX).bucket_routing)
        written = asyncio.create_task(
            self._written(routing, models, lambda eps: all(e.node != victim for e in eps))
        )
        out["node_lost"] = await self._every_router(
            s,
            f"{victim}'s endpoints gone",
            lambda r: self._node_gone(s, r, victim, models),
            a.node_lost_s + 30,
        )
        out["node_lost"]["node_lost_s"] = a.node_lost_s
        out["node_lost"]["row_written_s"] = await written
        fleet.silent.discard(victim)
        # A model scaled up (a catalog change): its new replica in every router's table.
        model = "m00001"
        before = len((await _routing(s, self.routers[0], model))["endpoints"])
        written = asyncio.create_task(self._written(routing, [model], lambda eps: len(eps) > before))
        reply = await ctl.catalog_apply(yaml.safe_dump(catalog(a.models, a.replicas, bump=model)))
        out["scale_up"] = await self._every_router(
            s,
            f"{model}'s new replica routed",
            lambda r: self._has_endpoints(s, r, model, before + 1),
            60,
        )
        out["scale_up"]["applied"] = str(reply)[:200]
        out["scale_up"]["row_written_s"] = await written
        dt = time.monotonic() - t_churn
        out["bus_during_churn"] = {"seconds": round(dt, 1), "rows": meter.rates(dt)[:15]}
        return out

    async def _written(self, kv: Any, models: list[str], ok: Any, timeout: float = 120.0) -> float | None:
        """Seconds until the control plane's rows of ``models`` all satisfy ``ok(endpoints)``: the
        change's time to the bus, apart from the routers' time to act on it."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            rows = []
            for m in models:
                row, _ = await bus.kv_get(kv, row_key(m), ModelRouting)
                rows.append(row.endpoints if row is not None else ())
            if all(ok(eps) for eps in rows):
                return round(time.monotonic() - t0, 3)
            await asyncio.sleep(0.05)
        return None

    def _victim(self, fleet: Fleet) -> tuple[str, list[str]]:
        for node, shards in sorted(fleet.shards.items()):
            if shards and all(s.shard == 0 for s in shards):
                return node, sorted({s.model for s in shards})
        raise RuntimeError("no node with a replica")

    async def _status_is(self, s: aiohttp.ClientSession, r: Proc, key: str, code: int) -> bool:
        return await self._status(s, r, key) == code

    async def _status_not(self, s: aiohttp.ClientSession, r: Proc, key: str, code: int) -> bool:
        got = await self._status(s, r, key)
        return got not in (0, code)

    async def _node_gone(self, s: aiohttp.ClientSession, r: Proc, node: str, models: list[str]) -> bool:
        for m in models:
            eps = (await _routing(s, r, m))["endpoints"]
            if any(e["node"] == node for e in eps):
                return False
        return True

    async def _has_endpoints(self, s: aiohttp.ClientSession, r: Proc, model: str, n: int) -> bool:
        return len((await _routing(s, r, model))["endpoints"]) >= n

    def stop(self) -> None:
        procs = [p.proc for p in self.routers + self.cps if p.proc is not None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.cluster.stop()


def report(out: dict[str, Any]) -> str:
    lines = [f"size: {out['size']}", f"placed: {out.get('placed')} in {out.get('place_all_s')} s"]
    for phase in ("steady", "loaded"):
        w = out.get(phase)
        if not w:
            continue
        lines.append(f"{phase}: bus {w['bus_msgs_s']} msg/s, {w['bus_bytes_s'] / 1e6:.2f} MB/s")
        for n, p in w["procs"].items():
            lines.append(f"  {n:8s} {p['kind']:22s} cpu {p['cpu_pct']:6.1f} %  rss {p['rss_mb']:6d} MB")
        for r in w["bus"][:12]:
            lines.append(
                f"  {r['subject']:45s} {r['msgs_s']:9.1f} msg/s {r['bytes_s'] / 1e3:10.1f} KB/s  max {r['largest']} B"
            )
        if "client" in w:
            lines.append(f"  client: {w['client']}")
    lines.append(f"passes (steady): {out.get('passes')}")
    lines.append(f"passes (churn): {out.get('passes_with_churn')}")
    lines.append(f"jetstream: {out.get('jetstream')}")
    for k, v in (out.get("churn") or {}).items():
        if k != "bus_during_churn":
            lines.append(
                f"churn {k}: all routers in {v.get('all_s')} s (missing {v.get('missing')}); "
                f"row written after {v.get('row_written_s', '-')} s"
            )
    largest = max(
        (r["largest"] for ph in ("steady", "loaded") for r in (out.get(ph) or {}).get("bus", [])), default=0
    )
    lines.append(f"largest message seen: {largest} bytes")
    return "\n".join(lines)


def _dump_tasks() -> None:
    """SIGUSR2: where every task of the bench waits (a run that seems stuck says where)."""
    for t in asyncio.all_tasks():
        print(f"--- {t.get_name()}", file=sys.stderr)
        t.print_stack(limit=8, file=sys.stderr)
    sys.stderr.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="hundredth")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--models", type=int)
    ap.add_argument("--replicas", type=int)
    ap.add_argument("--keys", type=int)
    ap.add_argument("--routers", type=int)
    ap.add_argument("--rate", type=float, default=20.0, help="client requests per second (0: none)")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--node-lost-s", type=float, default=30.0)
    ap.add_argument("--place-timeout-s", type=float, default=600.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kv-idle-from",
        choices=("replicas", "all", "none"),
        default="replicas",
        help="nodes sending the idle KV batch: with a replica (the agent since issue 35), all (before), none",
    )
    args = ap.parse_args()
    n, m, r, k, rt = SIZES[args.size]
    args.nodes = args.nodes or n
    args.models = args.models or m
    args.replicas = args.replicas or r
    args.keys = args.keys or k
    args.routers = args.routers or rt
    ensure_on_path()
    with tempfile.TemporaryDirectory(prefix="llmgw-fleet-") as d:
        b = Bench(args, Path(d))
        try:
            out = asyncio.run(b.run())
        finally:
            b.stop()
            if args.json is not None:
                logs = {p.name: p.read_text()[-3000:] for p in (Path(d) / "logs").glob("*.log")}
                args.json.with_suffix(".logs.json").write_text(json.dumps(logs, indent=1))
    print(report(out))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
