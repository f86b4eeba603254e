"""Fresh load (issue 34): how far behind the engines is the load a router decides on, and what it costs.

Part 1, real processes: a nats-server, a real agent process (``llmgw agent --simulate-engines``) running
``--replicas`` simulator processes, a router's endpoint pool (llmgw_router's ``Pool``) fed by the
agent's load reports over the bus, and clients sending requests straight to the engines (Poisson
arrivals, random lengths), so that the true number of requests in each engine is known at every
instant. At random decision times (``--decisions`` a second) each replica's view is judged:

- lag: how far the router's view (running + waiting) is behind the engine: 0 when it matches, else the
  time since the engine last had the value the router holds. This is "behind reality": what vLLM users
  measured at 3-6 s for gauges scraped at an interval (vllm-project/vllm#49538);
- line age: the time since the line the router holds was sent (a line unchanged is re-sent only every
  heartbeat, so this is large on idle replicas by design, and says nothing of being wrong).

With the agent's defaults (each engine read every 125 ms, a change sent at once, at most every 250 ms
per replica, unchanged every heartbeat), and ``--old``: read and sent every 1 s, as before issue 34.
The agent's and engines' CPU are reported, the price of reading 8 times as often.

Part 2, the bus at 1,000 replicas (``--nodes`` x ``--per-node``), synthetic as bench/controlplane_scale.py:
every replica's reading each 125 ms from a load model, paced by the agent's own ``LoadPacer``, encoded
as the agent sends them and published for real through a nats-server to a subscriber that applies them
to a router's ``Pool`` of 1,000 endpoints: messages and bytes a second, and the subscriber's time to take
them (each router and the control plane receive every message). Regimes: idle; moderate (each
replica's count changes about once a second); saturated (every reading differs: the cap, 4 lines a
second per replica); and the old scheme's cost (every node, every second, every line).

    .venv/bin/python bench/load_age.py                 # both parts, defaults
    .venv/bin/python bench/load_age.py --old           # part 1 as before issue 34
    .venv/bin/python bench/load_age.py --part 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import psutil
from nats.aio.msg import Msg

from llmgw_agent.load_pacing import LoadPacer, Pacing
from llmgw_common.codec import decode, encode
from llmgw_common.messages import (
    Assignment,
    Endpoint,
    LoadReport,
    ReplicaLoad,
    RoutingEndpoints,
    ShardAssignment,
)
from llmgw_common.subjects import Subjects
from llmgw_router.routing.endpoints import Pool
from llmgw_runtime.bus import ensure_kv
from llmgw_runtime.natsserver import NatsServer, ensure_on_path

PREFIX = "bench"
NODE = "age"
TOKENS_PER_S = 20.0
TICK_S = 0.125


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- part 1: the age at decision time


@dataclass
class Truth:
    """One engine's requests in flight, as its clients know them: (time, count from then) per change."""

    count: int = 0
    history: list[tuple[float, int]] = field(default_factory=lambda: [(0.0, 0)])

    def move(self, by: int) -> None:
        self.count += by
        self.history.append((time.time(), self.count))

    def lag(self, view: float, now: float) -> float:
        """0 when the view is the truth now, else the time since the truth last held the view."""
        if self.history[-1][1] == view:
            return 0.0
        for k in range(len(self.history) - 2, -1, -1):
            if self.history[k][1] == view:
                return now - self.history[k + 1][0]
        return now - self.history[0][0]


def start_agent(url: str, work: Path, old: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    if old:
        # As before issue 34: every engine read each second, sent as read (a line unchanged since the
        # last is re-sent each heartbeat instead of each second, which changes no lag).
        env |= {"LLMGW_LOAD_SCRAPE_S": "1.0", "LLMGW_LOAD_MIN_GAP_S": "0"}
    argv = [sys.executable, "-m", "llmgw_cli", "agent", "--nats", url, "--prefix", PREFIX, "--node", NODE]
    argv += ["--state-dir", str(work / "agent"), "--simulate-engines"]
    with (work / "agent.log").open("ab") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def part1(args: argparse.Namespace, work: Path) -> None:
    srv = NatsServer(work / "nats").start()
    nc = await nats.connect(srv.url)
    subjects = Subjects(PREFIX)
    ports = [free_port() for _ in range(args.replicas)]
    opts = {"ttft_ms": 1, "tokens_per_s": TOKENS_PER_S}
    shards = tuple(
        ShardAssignment(replica_id=f"r{i}", shard=0, model="m", engine="sim", port=p, options=opts)
        for i, p in enumerate(ports)
    )
    kv = await ensure_kv(nc.jetstream(), subjects.bucket_assign)
    await kv.put(NODE, encode(Assignment(node=NODE, fence=1, shards=shards)))
    agent = start_agent(srv.url, work, args.old)
    pool = Pool()
    eps = tuple(
        Endpoint(replica_id=f"r{i}", model="m", url=f"http://127.0.0.1:{p}", node=NODE)
        for i, p in enumerate(ports)
    )
    pool.set_endpoints(RoutingEndpoints(version=1, endpoints={"m": eps}))
    sent_at: dict[str, float] = {}
    bus = {"msgs": 0, "bytes": 0, "lines": 0}

    async def on_load(msg: Msg) -> None:
        rep = decode(msg.data, LoadReport)
        pool.apply_load(rep, time.time())
        bus["msgs"] += 1
        bus["bytes"] += len(msg.data)
        bus["lines"] += len(rep.replicas)
        for r in rep.replicas:
            sent_at[r.replica_id] = rep.sent_at

    await nc.subscribe(subjects.load(NODE), cb=on_load)
    truths = [Truth() for _ in ports]
    lags: list[float] = []
    wrong: list[float] = []
    ages: list[float] = []
    rng = random.Random(7)
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as http:
            deadline = time.time() + 120
            for p in ports:
                while True:
                    try:
                        if (await http.get(f"http://127.0.0.1:{p}/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.time() > deadline:
                        raise SystemExit(f"engines not ready; see {work / 'agent.log'}")
                    await asyncio.sleep(0.2)
            while any(pool.by_replica[f"r{i}"][0].load_at is None for i in range(len(ports))):
                await asyncio.sleep(0.1)
            start = time.time()
            for t in truths:
                t.history = [(start, 0)]

            async def one(i: int, tokens: int) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
                truths[i].move(+1)
                try:
                    await http.post(f"http://127.0.0.1:{ports[i]}/v1/chat/completions", json=body)
                finally:
                    truths[i].move(-1)

            async def clients(i: int, stop: float) -> None:
                pending: set[asyncio.Task[None]] = set()
                while time.time() < stop:
                    await asyncio.sleep(rng.expovariate(args.rate))
                    tokens = max(1, int(rng.expovariate(1 / (args.mean_s * TOKENS_PER_S))))
                    t = asyncio.create_task(one(i, tokens))
                    pending.add(t)
                    t.add_done_callback(pending.discard)
                await asyncio.gather(*pending)

            async def decisions(stop: float) -> None:
                while (now := time.time()) < stop:
                    await asyncio.sleep(rng.expovariate(args.decisions))
                    now = time.time()
                    if now - start < 3:
                        continue  # warm-up
                    for i, truth in enumerate(truths):
                        st = pool.by_replica[f"r{i}"][0]
                        view = (st.running or 0.0) + (st.waiting or 0.0)
                        lag = truth.lag(view, now)
                        lags.append(lag)
                        if lag > 0:
                            wrong.append(lag)
                        ages.append(now - sent_at.get(f"r{i}", now))

            cpu0 = _cpu(agent.pid)
            b0 = dict(bus)
            stop = start + args.seconds
            await asyncio.gather(*(clients(i, stop) for i in range(len(ports))), decisions(stop))
            elapsed = time.time() - start
            cpu1 = _cpu(agent.pid)
    finally:
        agent.terminate()
        await asyncio.to_thread(agent.wait, 30)
        await nc.close()
        srv.stop()
    mode = (
        "old: read and sent every 1 s"
        if args.old
        else "new: read every 125 ms, sent on change (>= 250 ms apart)"
    )
    print(
        f"\npart 1 ({mode}): {args.replicas} simulator processes, {args.rate}/s Poisson each, {args.mean_s} s mean"
    )
    print(f"  decisions judged: {len(lags)} ({args.decisions}/s x {args.replicas} replicas, {elapsed:.0f} s)")
    print(
        f"  lag behind the engine:  p50 {pct(lags, 50) * 1000:.0f} ms  p90 {pct(lags, 90) * 1000:.0f} ms"
        f"  p99 {pct(lags, 99) * 1000:.0f} ms  max {max(lags) * 1000:.0f} ms"
    )
    print(
        f"  on a wrong view: {len(wrong) / len(lags):.1%} of decisions; their lag p50 "
        f"{pct(wrong, 50) * 1000:.0f} ms, p99 {pct(wrong, 99) * 1000:.0f} ms"
    )
    print(
        f"  line age (since the line held was sent): p50 {pct(ages, 50) * 1000:.0f} ms, p99 {pct(ages, 99) * 1000:.0f} ms"
    )
    msgs, lines, byts = (bus[k] - b0[k] for k in ("msgs", "lines", "bytes"))
    print(f"  bus: {msgs / elapsed:.1f} msgs/s, {lines / elapsed:.1f} lines/s, {byts / elapsed:.0f} B/s")
    agent_cpu, engines_cpu = ((b - a) / elapsed * 100 for a, b in zip(cpu0, cpu1, strict=True))
    print(
        f"  CPU: agent {agent_cpu:.1f} % of a core, its {args.replicas} engines {engines_cpu:.1f} % together"
    )


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the agent, and of its children (the engines) together."""
    p = psutil.Process(pid)
    t = p.cpu_times()
    kids = 0.0
    for c in p.children(recursive=True):
        try:
            ct = c.cpu_times()
            kids += ct.user + ct.system
        except psutil.Error:
            pass
    return t.user + t.system, kids


# ---------------------------------------------------------------- part 2: the bus at 1,000 replicas


class Model:
    """Each replica's requests in flight, moved a tick at a time: arrivals Poisson(rate), each lasting
    an exponential time of mean ``mean_s``."""

    def __init__(self, n: int, rate: float, mean_s: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.count = [0] * n
        self.queries = [0.0] * n
        self.rate, self.mean_s = rate, mean_s

    def step(self, i: int) -> None:
        r = self.rng
        arrivals = 0
        t = r.expovariate(self.rate) if self.rate else TICK_S
        while t < TICK_S:
            arrivals += 1
            t += r.expovariate(self.rate)
        left = sum(1 for _ in range(self.count[i]) if r.random() < TICK_S / self.mean_s)
        self.count[i] += arrivals - left
        self.queries[i] += arrivals * 1000.0


def reading(rid: str, regime: str, model: Model, i: int, tick: int) -> ReplicaLoad:
    if regime == "idle":
        return ReplicaLoad(
            replica_id=rid, running=0.0, waiting=0.0, kv_use=0.0, prefix_queries=0.0, prefix_hits=0.0
        )
    if regime == "saturated":
        # A busy engine's KV use moves at every step: every reading differs.
        return ReplicaLoad(
            replica_id=rid,
            running=16.0,
            waiting=4.0,
            kv_use=(tick % 97) / 97,
            prefix_queries=tick * 1e4,
            prefix_hits=tick * 5e3,
        )
    model.step(i)
    c = float(model.count[i])
    return ReplicaLoad(
        replica_id=rid,
        running=c,
        waiting=0.0,
        kv_use=c / 32,
        prefix_queries=model.queries[i],
        prefix_hits=model.queries[i] / 2,
    )


async def part2(args: argparse.Namespace, work: Path) -> None:
    srv = NatsServer(work / "nats2").start()
    pub = await nats.connect(srv.url)
    sub = await nats.connect(srv.url)
    subjects = Subjects(PREFIX)
    nodes = [f"n{k:04d}" for k in range(args.nodes)]
    rids = {n: [f"{n}-r{j}" for j in range(args.per_node)] for n in nodes}
    pool = Pool()
    eps = tuple(
        Endpoint(replica_id=r, model=f"m{j}", url=f"http://10.0.0.1:{j}", node=n)
        for n in nodes
        for j, r in enumerate(rids[n])
    )
    by_model: dict[str, list[Endpoint]] = {}
    for e in eps:
        by_model.setdefault(e.model, []).append(e)
    pool.set_endpoints(RoutingEndpoints(version=1, endpoints={m: tuple(v) for m, v in by_model.items()}))
    got = {"msgs": 0, "bytes": 0, "lines": 0, "busy_s": 0.0}

    async def on_load(msg: Msg) -> None:
        t0 = time.perf_counter()
        rep = decode(msg.data, LoadReport)
        pool.apply_load(rep, time.time())
        got["busy_s"] += time.perf_counter() - t0
        got["msgs"] += 1
        got["lines"] += len(rep.replicas)
        # The wire: "MSG <subject> <sid> <size>\r\n<payload>\r\n".
        got["bytes"] += len(msg.data) + len(msg.subject) + 16

    await sub.subscribe(subjects.all_nodes("load"), cb=on_load)
    await sub.flush()
    print(
        f"\npart 2: the bus at {args.nodes * args.per_node} replicas ({args.nodes} nodes x {args.per_node}), one subscriber"
    )
    print("  | regime | msgs/s | lines/s | bytes/s (wire) | subscriber's time |")
    print("  | --- | ---: | ---: | ---: | ---: |")
    for regime in ("idle", "moderate", "saturated", "old"):
        pacers = {n: LoadPacer(Pacing(min_gap_s=0.25, max_gap_s=2.0)) for n in nodes}
        model = Model(len(eps), rate=0.5, mean_s=2.0, seed=1)
        for k in got:
            got[k] = 0 if k != "busy_s" else 0.0
        t0 = time.monotonic()
        tick = 0
        while time.monotonic() - t0 < args.seconds:
            at = t0 + tick * TICK_S
            i = 0
            for n in nodes:
                lines = tuple(
                    reading(r, "moderate" if regime == "old" else regime, model, i + j, tick)
                    for j, r in enumerate(rids[n])
                )
                i += len(lines)
                if regime == "old":
                    # Every node every second, every line.
                    send = lines if tick % 8 == 0 else ()
                else:
                    send = pacers[n].take(lines, at, [(r, 0) for r in rids[n]])
                if send:
                    await pub.publish(
                        subjects.load(n), encode(LoadReport(node=n, sent_at=time.time(), replicas=send))
                    )
            await pub.flush()
            tick += 1
            await asyncio.sleep(max(0.0, t0 + tick * TICK_S - time.monotonic()))
        await asyncio.sleep(0.3)
        el = time.monotonic() - t0
        name = "old (1 s, all lines)" if regime == "old" else regime
        print(
            f"  | {name} | {got['msgs'] / el:,.0f} | {got['lines'] / el:,.0f} | {got['bytes'] / el:,.0f} |"
            f" {got['busy_s'] / el * 100:.2f} % of a core |"
        )
    await pub.close()
    await sub.close()
    srv.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", type=int, choices=(1, 2), help="only this part")
    ap.add_argument("--old", action="store_true", help="part 1 with the agent as before issue 34")
    ap.add_argument("--replicas", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rate", type=float, default=1.0, help="requests a second per replica")
    ap.add_argument("--mean-s", type=float, default=1.0, help="mean request length")
    ap.add_argument("--decisions", type=float, default=50.0, help="decisions judged a second")
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--bus-seconds", type=float, default=10.0, dest="bus_seconds")
    args = ap.parse_args()
    ensure_on_path()
    with tempfile.TemporaryDirectory(prefix="load-age-") as d:
        if args.part in (None, 1):
            await part1(args, Path(d))
        if args.part in (None, 2):
            args.seconds = args.bus_seconds
            await part2(args, Path(d))


if __name__ == "__main__":
    asyncio.run(main())
