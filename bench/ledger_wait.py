"""What the usage ledger's wait costs each answer, and what writing it asynchronously would risk (issue 36,
point 4): in cluster mode, side by side in one run.

Three nats-servers as one JetStream cluster (``tests/natscluster``'s ``NatsCluster``, from the
production configs), every bucket R3, and two ``llmgw router`` processes for each variant:

- ``sync``: today's router: an answer's last bytes wait for the ledger's group-commit write.
- ``async``: the same router with the wait patched out (``Ledger.settled`` returns at once); the writer
  is still woken by every answer's usage, so it writes back to back, one KV round trip each.
- ``async-paced``: the wait patched out and the writer paced: woken by usage as before (a lone answer
  is written at once), but at most one write per ``--interval-ms`` (100 ms): fewer writes under load,
  a loss window of at most that plus one write.

The two patched variants are BENCH-ONLY monkeypatches, applied by this script's own router launcher
(``ledger_wait.py router-child VARIANT -- ARGS``) before it starts ``llmgw router ARGS``: nothing in
``services/`` changes. The router and engine processes run the source of ``--rev`` (default HEAD, by
``git archive`` as ``bench/router_ab.py`` does), so a work tree being edited meanwhile does not break
the run; ``--rev worktree`` runs the work tree.

Part 1, latency and CPU: a zero-delay sim engine and a realistic one (``--ttft-ms 100``,
``--tokens-per-s 50``), 16-token answers, 1 and 32 closed-loop clients over the variant's two routers,
streamed (with ``stream_options.include_usage``) and not. The variants' slices alternate (rotated
order, ``--rounds`` rounds) so whatever else loads the machine loads all three. Per variant: client
latency p50/p99 and its difference to ``async`` (noisy on a shared box); the wait itself, timed inside
the routers (a probe in each: every answer's time in ``settled``, the direct figure); router CPU per
request (both routers) and the three nats-servers' (each net of its idle rate: meaningless at the
realistic engine's 2.5 answers/s); KV writes per request (the usage stream's sequence); and for each
acknowledged write, the age of the oldest usage it covered ("unwritten"): for the async variants what
a SIGKILL at that moment would lose; for ``sync`` the same time spent waiting instead, nothing lost.

Part 2, loss: for each variant, 32 clients (half streamed) on one router, a fresh API key, and the
router SIGKILLed 2-3 s in (``--kills`` times), then SIGTERMed once; lost = answers the clients had
whole minus the requests the ledger holds for the key (read after the kill), the loss window = lost /
the answer rate of the second before the kill. A negative loss is an answer billed but not had
(written, then the router died before its last byte).

    .venv/bin/python bench/ledger_wait.py             # about 7 minutes on a loaded 2-core box
    .venv/bin/python bench/ledger_wait.py --quick     # about 3 minutes, rougher
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import psutil
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

# The test kit's free port and three-server cluster, and router_overhead's engine launcher.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.kit.ports import free_port
from tests.natscluster.natscluster_harness import NatsCluster

import router_overhead as ro
from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, RoutingCatalog, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key
from llmgw_runtime.usage_ledger import By, fold, read_hours

VARIANTS = ("sync", "async", "async-paced")
# Ledger.run's back-off after a failed flush (llmgw_router.ledger.RETRY_S), for the paced writer.
RETRY_S = 0.5
PREFIX = "lw"
MAX_TOKENS = 16
CLIENT_TIMEOUT_S = 30.0
REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("libs/llmgw_common", "libs/llmgw_runtime", "services/router", "services/cli", "services/agent",
            "services/controlplane", "services/notifier", "services/sim")  # fmt: skip


# ---------------------------------------------------------------- the bench-only router launcher


def _ledger_class() -> Any:
    """The router's ``Ledger``, wherever the router's restructuring (issue 36) has put it."""
    for name in ("llmgw_router.tenancy.ledger", "llmgw_router.ledger"):
        with contextlib.suppress(ModuleNotFoundError):
            return importlib.import_module(name).Ledger
    raise SystemExit("ledger_wait: no Ledger in llmgw_router.tenancy.ledger nor llmgw_router.ledger")


class _Probe:
    """BENCH ONLY, in each router: how long each answer's end waited in ``settled`` (sync), and, for
    each acknowledged write, how long the oldest usage it covered had been unwritten (the loss window a
    SIGKILL at that moment would have cut). Dumped to ``<file>.<n>`` on SIGUSR1, then emptied."""

    def __init__(self, path: str) -> None:
        self.path, self.dumps = path, 0
        self.waits: list[float] = []
        self.exposure: list[float] = []
        self.first: float | None = None  # when the oldest usage not yet in a flush was added

    def dump(self) -> None:
        tmp = f"{self.path}.tmp"
        Path(tmp).write_text(json.dumps({"waits": self.waits, "exposure": self.exposure}))
        os.rename(tmp, f"{self.path}.{self.dumps}")
        self.dumps += 1
        self.waits, self.exposure = [], []


def _router_child(variant: str, interval_s: float, argv: list[str]) -> None:
    """BENCH ONLY: ``llmgw router ARGV`` with the ledger's wait patched out (``async``), and its writer
    paced to one write per ``interval_s`` at most (``async-paced``). ``sync`` runs the router's ledger
    as it is. All three carry the probe (a clock read and a list append per answer and per write)."""
    if variant not in VARIANTS:
        raise SystemExit(f"ledger_wait: unknown variant {variant!r}")
    ledger = _ledger_class()
    probe = _Probe(os.environ["LW_PROBE_FILE"])
    clock = time.perf_counter
    orig_kick, orig_flush, orig_settled, orig_run = ledger.kick, ledger.flush, ledger.settled, ledger.run

    def kick(self: Any) -> None:
        if probe.first is None:
            probe.first = clock()
        orig_kick(self)

    async def flush(self: Any) -> bool:
        # Ledger.flush takes the hours marked so far before its first await: the adds until now are
        # this write's, those after it the next one's.
        first, probe.first = probe.first, None
        ok: bool = await orig_flush(self)
        if first is not None:
            if ok:
                probe.exposure.append(clock() - first)
            elif probe.first is None or first < probe.first:
                probe.first = first  # still unwritten: kept marked for the next
        return ok

    async def timed_settled(self: Any, version: int) -> None:
        t0 = clock()
        await orig_settled(self, version)
        probe.waits.append(clock() - t0)

    async def no_wait(self: Any, version: int) -> None:
        # No wait: the answer's end goes out at once; the writer, woken by the usage's add (kick), writes
        # it with its next flush.
        return None

    async def paced_run(self: Any) -> None:
        # Ledger.run with one line added (the pacing sleep): woken by usage as before, so a lone answer is
        # written at once, but at most one write per interval_s, whatever the rate. Reaches the class's
        # own _wanted: this replaces one of its methods.
        loop = asyncio.get_running_loop()
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            t0 = loop.time()
            if not await self.flush():
                await asyncio.sleep(RETRY_S)
                self._wanted.set()
                continue
            await asyncio.sleep(max(0.0, interval_s - (loop.time() - t0)))

    base_run = paced_run if variant == "async-paced" else orig_run

    async def run(self: Any) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, probe.dump)
        await base_run(self)

    setattr(ledger, "kick", kick)  # noqa: B010 (monkeypatches, said as such)
    setattr(ledger, "flush", flush)  # noqa: B010
    setattr(ledger, "settled", timed_settled if variant == "sync" else no_wait)  # noqa: B010
    setattr(ledger, "run", run)  # noqa: B010
    from llmgw_cli.main import main  # the router's own entry point, as `python -m llmgw_cli`

    sys.argv = ["llmgw", "router", *argv]
    main()


# ---------------------------------------------------------------- processes


def export_tree(rev: str, into: Path) -> str:
    """``rev``'s source in ``into`` (git archive: no work tree touched); the PYTHONPATH that runs it."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True)
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return ":".join(str(into / p) for p in PACKAGES)


def cpu_s(pid: int) -> float:

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(t.user + t.system)


def stop_proc(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait_s: float = 20.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class RouterProc:
    variant: str
    rid: str
    port: int
    nats: str
    logs: Path
    interval_s: float
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    dumps: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def probe_file(self) -> Path:
        return self.logs / f"{self.rid}.{self.incarnation}.probe"

    def start(self) -> None:
        self.incarnation += 1
        self.dumps = 0
        env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING", LLMGW_KV_REPLICAS="3")
        env["LW_PROBE_FILE"] = str(self.probe_file)
        argv = [sys.executable, str(Path(__file__).resolve()), "router-child", self.variant]
        argv += [str(self.interval_s), "--", "--nats", self.nats, "--prefix", PREFIX]
        argv += ["--port", str(self.port), "--router-id", self.rid, "--admin-port", "0"]
        out = (self.logs / f"{self.rid}.log").open("ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)
        out.close()

    async def probe(self) -> dict[str, list[float]]:
        """The router's probe since the last call (see _Probe): answers' waits, writes' exposure."""
        os.kill(self.pid, signal.SIGUSR1)
        path = Path(f"{self.probe_file}.{self.dumps}")
        for _ in range(100):
            data = _read_probe(path)
            if data is not None:
                self.dumps += 1
                return data
            await asyncio.sleep(0.05)
        raise RuntimeError(f"router {self.rid} wrote no {path}")


def _read_probe(path: Path) -> dict[str, list[float]] | None:
    """A probe's dump once it is there (renamed into place: whole)."""
    try:
        data: dict[str, list[float]] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data


# ---------------------------------------------------------------- load


def body(model: str, stream: bool) -> bytes:
    b: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
    b["max_tokens"] = MAX_TOKENS
    if stream:
        b |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(b).encode()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    v = sorted(xs)
    return v[min(len(v) - 1, int(q * len(v)))]


@dataclass
class Tally:
    lat_ms: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    router_cpu_s: float = 0.0
    nats_cpu_s: float = 0.0
    writes: int = 0
    waits_ms: list[float] = field(default_factory=list)  # in the routers: each answer's wait (sync)
    exposure_ms: list[float] = field(default_factory=list)  # each write: its oldest usage's age at the ack
    done_at: list[float] = field(default_factory=list)  # monotonic time of each whole answer


async def one(s: aiohttp.ClientSession, url: str, data: bytes, stream: bool, t: Tally) -> bool:

    t0 = time.perf_counter()
    try:
        async with s.post(url, data=data) as r:
            got = await r.read()
            good = r.status == 200 and (not stream or got.endswith(b"data: [DONE]\n\n"))
    except (aiohttp.ClientError, TimeoutError):
        good = False
    if good:
        t.ok += 1
        t.lat_ms.append((time.perf_counter() - t0) * 1000)
        t.done_at.append(time.monotonic())
    else:
        t.errors += 1
    return good


async def closed_loop(
    s: aiohttp.ClientSession, urls: list[str], data: bytes, stream: bool, conc: int, seconds: float
) -> Tally:
    """``conc`` clients, each sending back to back, its requests alternating over ``urls``."""
    t = Tally()
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def client(j: int) -> None:
        k = j
        while loop.time() < end:
            await one(s, urls[k % len(urls)], data, stream, t)
            k += 1

    t0 = loop.time()
    await asyncio.gather(*(client(j) for j in range(conc)))
    t.seconds = loop.time() - t0
    return t


def merge(into: Tally, part: Tally) -> None:
    into.lat_ms += part.lat_ms
    into.ok += part.ok
    into.errors += part.errors
    into.seconds += part.seconds
    into.router_cpu_s += part.router_cpu_s
    into.nats_cpu_s += part.nats_cpu_s
    into.writes += part.writes
    into.waits_ms += part.waits_ms
    into.exposure_ms += part.exposure_ms


# ---------------------------------------------------------------- the run


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.routers: dict[str, list[RouterProc]] = {}
        self.nc: NATS | None = None
        self.js: JetStreamContext | None = None
        self.usage_kv: KeyValue | None = None
        self.cluster: NatsCluster | None = None

    async def kv_seq(self) -> int:
        assert self.js is not None
        info = await self.js.stream_info(f"KV_{Subjects(PREFIX).bucket_usage}")
        return int(info.state.last_seq)

    def nats_cpu(self) -> float:
        assert self.cluster is not None
        return sum((cpu_s(srv.proc.pid) for srv in self.cluster.servers if srv.proc is not None), 0.0)

    async def ready(self, s: aiohttp.ClientSession, r: RouterProc, data: bytes, timeout: float = 30.0) -> int:
        """Until ``r`` answers ``data`` with a 200 (catalog, endpoints and key followed); the 200s."""
        deadline = time.monotonic() + timeout
        t = Tally()
        while time.monotonic() < deadline:
            assert r.proc is not None
            if r.proc.poll() is not None:
                raise RuntimeError(f"router {r.rid} exited ({r.proc.returncode}); see {self.root}/logs")
            if await one(s, r.url, data, False, t):
                return t.ok
            await asyncio.sleep(0.1)
        raise RuntimeError(f"router {r.rid} did not answer in {timeout:g}s; see {self.root}/logs")

    async def setup(self) -> str:

        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.cluster = NatsCluster(self.root / "nats")
        self.cluster.start()
        leader, took = self.cluster.wait_meta_leader()
        print(f"nats: 3 servers, meta leader {leader} after {took:.1f}s", flush=True)
        urls = ",".join(self.cluster.urls)
        eng0, url0 = ro.start_engine("--zero", "--slots", "4096", model="zero")
        self.procs.append(eng0)
        a = self.args
        real = ["--ttft-ms", str(a.ttft_ms), "--tokens-per-s", str(a.tokens_per_s), "--slots", "4096"]
        eng1, url1 = ro.start_engine(*real, model="real")
        self.procs.append(eng1)
        self.nc = await nats.connect(self.cluster.urls)
        self.js = self.nc.jetstream()
        buckets = await bus.ensure_all(self.js, Subjects(PREFIX), replicas=3)
        self.usage_kv = buckets[Subjects(PREFIX).bucket_usage]
        cat = Catalog(
            models=(ModelProfile(name="zero", engine="sim"), ModelProfile(name="real", engine="sim"))
        )
        routing = buckets[Subjects(PREFIX).bucket_routing]
        await routing.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))
        eps = {
            "zero": (Endpoint(replica_id="r0", model="zero", url=url0, node="n1"),),
            "real": (Endpoint(replica_id="r1", model="real", url=url1, node="n1"),),
        }
        await routing.put("endpoints", encode(RoutingEndpoints(version=1, endpoints=eps)))
        key, _ = await create_key(self.nc, PREFIX, "bench")
        for v in VARIANTS:
            self.routers[v] = []
            for i in range(2):
                r = RouterProc(v, f"{v}-{i}", free_port(), urls, logs, a.interval_ms / 1000)
                r.start()
                self.routers[v].append(r)
        return key

    async def latency(self, s: aiohttp.ClientSession) -> dict[str, Any]:
        a = self.args
        cases = [
            ("zero", False, 1, a.slice_s),
            ("zero", True, 1, a.slice_s),
            ("zero", False, 32, a.slice_s),
            ("zero", True, 32, a.slice_s),
            # ~2.5 answers a second: a longer slice for a few dozen samples (the p99 is near the max).
            ("real", False, 1, a.slice_s * 3),
            ("real", True, 1, a.slice_s * 3),
            ("real", False, 32, a.slice_s),
            ("real", True, 32, a.slice_s),
        ]
        # What the processes burn idle (ticks, reports, followers, the cluster's own chatter), per
        # second: taken off each slice, so that CPU per request is the requests' own.
        pids = [r.pid for rs in self.routers.values() for r in rs]
        at_rest, n0, t0 = {p: cpu_s(p) for p in pids}, self.nats_cpu(), time.monotonic()
        await asyncio.sleep(3.0)
        idle_s = time.monotonic() - t0
        idle = {p: (cpu_s(p) - at_rest[p]) / idle_s for p in pids}
        idle_nats = (self.nats_cpu() - n0) / idle_s
        print(
            f"idle CPU: routers {1000 * sum(idle.values()) / len(pids):.1f} ms/s each, "
            f"nats-servers {1000 * idle_nats:.1f} ms/s together",
            flush=True,
        )
        out: dict[str, Any] = {}
        for model, stream, conc, seconds in cases:
            name = f"{model} {'stream' if stream else 'whole'} {conc}c"
            data = body(model, stream)
            tallies = {v: Tally() for v in VARIANTS}
            for rnd in range(a.rounds):
                order = list(VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3])
                for v in order:
                    rs = self.routers[v]
                    await closed_loop(s, [r.url for r in rs], data, stream, conc, 0.3)  # warm
                    await asyncio.sleep(0.1)  # the warm-up's writes land before the slice
                    for r in rs:
                        await r.probe()  # emptied: the slice's own from here
                    w0, t0 = await self.kv_seq(), time.monotonic()
                    c0, n0 = sum(cpu_s(r.pid) for r in rs), self.nats_cpu()
                    t = await closed_loop(s, [r.url for r in rs], data, stream, conc, seconds)
                    await asyncio.sleep(0.2)  # the last write of the slice lands in it
                    c1, n1, took = sum(cpu_s(r.pid) for r in rs), self.nats_cpu(), time.monotonic() - t0
                    t.router_cpu_s = c1 - c0 - took * sum(idle[r.pid] for r in rs)
                    t.nats_cpu_s = n1 - n0 - took * idle_nats
                    t.writes = await self.kv_seq() - w0
                    for r in rs:
                        got = await r.probe()
                        t.waits_ms += [1000 * x for x in got["waits"]]
                        t.exposure_ms += [1000 * x for x in got["exposure"]]
                    merge(tallies[v], t)
            base = tallies["async"]
            row: dict[str, Any] = {}
            for v, t in tallies.items():
                n = max(t.ok, 1)
                row[v] = {
                    "n": t.ok,
                    "errors": t.errors,
                    "rps": round(t.ok / t.seconds, 1) if t.seconds else 0.0,
                    "p50_ms": round(pct(t.lat_ms, 0.5), 2),
                    "p99_ms": round(pct(t.lat_ms, 0.99), 2),
                    "added_p50_ms": round(pct(t.lat_ms, 0.5) - pct(base.lat_ms, 0.5), 2),
                    "added_p99_ms": round(pct(t.lat_ms, 0.99) - pct(base.lat_ms, 0.99), 2),
                    "router_cpu_ms_per_req": round(t.router_cpu_s * 1000 / n, 3),
                    "nats_cpu_ms_per_req": round(t.nats_cpu_s * 1000 / n, 3),
                    "kv_writes_per_req": round(t.writes / n, 3),
                    "wait_p50_ms": round(pct(t.waits_ms, 0.5), 2) if t.waits_ms else 0.0,
                    "wait_p99_ms": round(pct(t.waits_ms, 0.99), 2) if t.waits_ms else 0.0,
                    "unwritten_p50_ms": round(pct(t.exposure_ms, 0.5), 2),
                    "unwritten_p99_ms": round(pct(t.exposure_ms, 0.99), 2),
                    "unwritten_max_ms": round(max(t.exposure_ms, default=float("nan")), 2),
                }
            out[name] = row
            print(name, json.dumps(row), flush=True)
        return out

    async def loss(self, s: aiohttp.ClientSession, variant: str, sig: int, n: int) -> dict[str, Any]:
        """One kill (``sig``) of the variant's first router under 32 clients; answered vs ledgered."""

        r = self.routers[variant][0]
        key, rec = await create_key(self.nc, PREFIX, f"loss-{variant}-{n}-{sig}")

        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        t = Tally()
        started = time.time()
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
        ) as ks:
            first = await self.ready(ks, r, body("zero", False))
            killed = asyncio.Event()

            async def client(j: int) -> None:
                stream = j % 2 == 1
                data = body("zero", stream)
                while True:
                    if not await one(ks, r.url, data, stream, t) and killed.is_set():
                        return
                    if killed.is_set() and r.proc is not None and r.proc.poll() is not None:
                        return

            clients = [asyncio.create_task(client(j)) for j in range(32)]
            await asyncio.sleep(2.0 + random.random())
            t_kill = time.monotonic()
            os.kill(r.pid, sig)
            killed.set()
            await asyncio.wait_for(asyncio.gather(*clients), 60)
        assert r.proc is not None
        await asyncio.get_running_loop().run_in_executor(None, r.proc.wait)
        answered = t.ok + first
        recent = sum(1 for x in t.done_at if t_kill - 1.0 <= x <= t_kill)
        await asyncio.sleep(1.0)  # every replica has the last acknowledged write
        assert self.usage_kv is not None
        hours = await read_hours(self.usage_kv, started)
        ledgered = sum(row.requests for row in fold(hours, By.MODEL, key_id=rec.id))
        lost = answered - ledgered
        res = {
            "variant": variant,
            "signal": "SIGKILL" if sig == signal.SIGKILL else "SIGTERM",
            "answered": answered,
            "ledgered": ledgered,
            "lost": lost,
            "rps_before": recent,
            "loss_window_ms": round(max(lost, 0) * 1000 / recent, 1) if recent else None,
        }
        print("loss", json.dumps(res), flush=True)
        r.start()  # a new incarnation (its own ledger keys), for the next round
        async with aiohttp.ClientSession(headers=headers) as ks:
            await self.ready(ks, r, body("zero", False))
        return res

    def close(self) -> None:
        for rs in self.routers.values():
            for r in rs:
                if r.proc is not None:
                    stop_proc(r.proc)
        for p in self.procs:
            stop_proc(p)
        if self.cluster is not None:
            self.cluster.stop()


async def amain(args: argparse.Namespace) -> int:

    root = Path(tempfile.mkdtemp(prefix="llmgw-ledgerwait-"))
    if args.rev != "worktree":
        os.environ["PYTHONPATH"] = export_tree(args.rev, root / "src")
    bench = Bench(args, root)
    try:
        key = await bench.setup()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
        ) as s:
            for rs in bench.routers.values():
                for r in rs:
                    await bench.ready(s, r, body("zero", False))
            print("routers ready: " + ", ".join(r.rid for rs in bench.routers.values() for r in rs))
            lat = await bench.latency(s)
        losses = []
        for k in range(args.kills):
            for v in VARIANTS:
                losses.append(await bench.loss(s, v, signal.SIGKILL, k))
        for v in VARIANTS:
            losses.append(await bench.loss(s, v, signal.SIGTERM, 0))
    except BaseException:
        print(f"logs kept: {root}/logs", file=sys.stderr)
        raise
    finally:
        if bench.nc is not None:
            await bench.nc.close()
        bench.close()
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"latency": lat, "loss": losses}, indent=1))
    print(summary(lat, losses))
    return 0


def summary(lat: dict[str, Any], losses: list[dict[str, Any]]) -> str:
    """The figures as Markdown tables: latency and CPU per case, then the loss per variant."""
    out = [
        "| case | variant | n | p50 ms | p99 ms | added p50 / p99 ms (vs async) | wait in the router p50 / "
        "p99 ms | router CPU ms/req | nats CPU ms/req | KV writes/req | unwritten p50 / p99 / max ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case, row in lat.items():
        for v, m in row.items():
            out.append(
                f"| {case} | {v} | {m['n']} | {m['p50_ms']} | {m['p99_ms']} "
                f"| {m['added_p50_ms']:+} / {m['added_p99_ms']:+} | {m['wait_p50_ms']} / {m['wait_p99_ms']} "
                f"| {m['router_cpu_ms_per_req']} | {m['nats_cpu_ms_per_req']} | {m['kv_writes_per_req']} "
                f"| {m['unwritten_p50_ms']} / {m['unwritten_p99_ms']} / {m['unwritten_max_ms']} |"
            )
    out += ["", "| variant | signal | answered | in the ledger | lost (- : billed, not had) | rate before, /s "
            "| loss window ms |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for x in losses:
        out.append(
            f"| {x['variant']} | {x['signal']} | {x['answered']} | {x['ledgered']} | {x['lost']} "
            f"| {x['rps_before']} | {x['loss_window_ms']} |"
        )
    return "\n".join(out)


def main() -> int:
    if sys.argv[1:2] == ["router-child"]:
        # ledger_wait.py router-child VARIANT INTERVAL_S -- ROUTER ARGS. SIGUSR1 (the probe's dump) is
        # ignored until the ledger's writer installs its handler: never the signal's default, an exit.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        variant, interval_s = sys.argv[2], float(sys.argv[3])
        rest = sys.argv[4:]
        _router_child(variant, interval_s, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter slices, one round less, one kill")
    ap.add_argument("--rev", default="HEAD", help="the revision the routers and engines run, or 'worktree'")
    ap.add_argument("--interval-ms", type=float, default=100.0, help="async-paced: at most one write per")
    ap.add_argument("--ttft-ms", type=float, default=100.0, help="the realistic engine's first token")
    ap.add_argument("--tokens-per-s", type=float, default=50.0, help="the realistic engine's rate")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slice-s", type=float, default=3.0, help="seconds per variant and round")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs per variant")
    args = ap.parse_args()
    if args.quick:
        args.slice_s, args.rounds, args.kills = 1.5, 2, 1
    try:
        import uvloop
    except ImportError:
        return asyncio.run(amain(args))
    return uvloop.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
