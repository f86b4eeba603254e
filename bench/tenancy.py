"""Tenancy across routers, measured: how far over a key's limit three routers go, and whether a key
under its limit is ever refused.

A real nats-server, a zero-delay simulated engine and three ``llmgw router`` processes on the bus
(tick ``--tick-s``). Two keys with the same ``--rpm``: ``flood`` is sprayed over all three routers
at ``--times`` its limit (default 10x), ``steady`` at half its limit. The run starts at a UTC minute
and lasts ``--minutes`` whole minutes; each request is put in the UTC minute of the middle of its
round trip (the routers' windows are UTC minutes).

    .venv/bin/python bench/tenancy.py                     # 2 minutes, rpm 600, 10x: about 3 minutes
    .venv/bin/python bench/tenancy.py --minutes 3 --rpm 1200 --tick-s 0.5

Prints per minute: flood's admitted requests and over-admission (% of the limit), statuses other than
200/429, and steady's refusals (the goal: none), then a JSON line of the same.

``--fair``: fair queueing instead. A second model on a 100 ms engine, ``max_concurrency: 1`` per
router (capacity about 30 requests/s over the three); a light key sends one request a second, first
alone (``--fair-s`` seconds), then while a batch key floods all routers at ``--fair-times`` (20) the
capacity. Prints the light key's wait p50/p99 in both phases and their ratio (the goal: p99 within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp
import nats

from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.codec import encode
from llmgw_common.messages import Endpoint, KeyLimits, RoutingCatalog, RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.apikeys import create_key, update_key
from llmgw_runtime.natsserver import NatsServer, ensure_on_path

# The one free-port helper (tests/kit/ports.py), as bench/autoscale.py reaches the test kit.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kit.ports import free_port

PREFIX = "tenancy"
MODEL = "m1"
SLOW = "m2"  # --fair: the model whose gate is saturated
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
SLOW_BODY = {**BODY, "model": SLOW}


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


async def publish_routing(url: str, engine: str, slow: str) -> tuple[str, str]:
    """The catalog and the engines' endpoints in the routing bucket; the two keys. Returns the keys."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        kv = await bus.ensure_kv(js, Subjects(PREFIX).bucket_routing)
        gated = ModelProfile(name=SLOW, engine="sim", max_concurrency=1, max_queue=200, queue_timeout_s=30)
        cat = Catalog(models=(ModelProfile(name=MODEL, engine="sim"), gated))
        await kv.put("catalog", encode(RoutingCatalog(version=1, catalog=cat)))
        eps = {
            MODEL: (Endpoint(replica_id="r1", model=MODEL, url=engine, node="n1"),),
            SLOW: (Endpoint(replica_id="r2", model=SLOW, url=slow, node="n1"),),
        }
        await kv.put("endpoints", encode(RoutingEndpoints(version=1, endpoints=eps)))
        return (
            (await create_key(nc, PREFIX, "flood", limits=KeyLimits(rpm=ARGS.rpm)))[0],
            (await create_key(nc, PREFIX, "steady", limits=KeyLimits(rpm=ARGS.rpm)))[0],
        )
    finally:
        await nc.close()


async def wait_200(s: aiohttp.ClientSession, url: str, key: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.post(url, json=BODY, headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} never answered 200")
        await asyncio.sleep(0.2)


async def drive(
    s: aiohttp.ClientSession,
    urls: list[str],
    key: str,
    rate: float,
    until: float,
    out: list[tuple[float, int]],
    body: dict[str, object] = BODY,
    waits: list[float] | None = None,
) -> None:
    """Open loop at ``rate`` requests/s round-robin over ``urls`` until wall time ``until``."""
    inflight: set[asyncio.Task[None]] = set()
    hdr = {"Authorization": f"Bearer {key}"}

    async def one(url: str) -> None:
        t0 = time.time()
        try:
            async with s.post(url, json=body, headers=hdr) as r:
                await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError):
            status = -1
        out.append(((t0 + time.time()) / 2, status))
        if waits is not None and status == 200:
            waits.append(time.time() - t0)

    start, i = time.time(), 0
    while True:
        at = start + i / rate
        if at >= until:
            break
        await asyncio.sleep(max(0.0, at - time.time()))
        if len(inflight) < 512:  # a stalled router must not make the client unbounded
            t = asyncio.create_task(one(urls[i % len(urls)]))
            inflight.add(t)
            t.add_done_callback(inflight.discard)
        i += 1
    await asyncio.gather(*inflight)


def minutes_of(results: list[tuple[float, int]], first: float, n: int) -> list[Counter[int]]:
    per: defaultdict[int, Counter[int]] = defaultdict(Counter)
    for t, status in results:
        m = math.floor((t - first) / 60)
        if 0 <= m < n:
            per[m][status] += 1
    return [per[m] for m in range(n)]


async def main() -> None:
    ensure_on_path()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        srv = NatsServer(work / "nats")
        srv.start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            eport = free_port()
            procs.append(
                spawn(
                    [
                        sys.executable,
                        "-m",
                        "llmgw_cli",
                        "sim-engine",
                        "--zero",
                        "--port",
                        str(eport),
                        "--model",
                        MODEL,
                        "--slots",
                        "256",
                    ],
                    work / "engine.log",
                )
            )
            sport = free_port()
            slow_argv = [
                sys.executable,
                "-m",
                "llmgw_cli",
                "sim-engine",
                "--port",
                str(sport),
                "--model",
                SLOW,
            ]
            slow_argv += ["--ttft-ms", "100", "--tokens-per-s", "1000", "--slots", "64"]
            procs.append(spawn(slow_argv, work / "slow-engine.log"))
            flood, steady = await publish_routing(
                srv.url, f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{sport}"
            )
            env = dict(os.environ, LLMGW_LOG_LEVEL="WARNING", LLMGW_TICK_S=str(ARGS.tick_s))
            urls = []
            for i in range(3):
                port = free_port()
                argv = [sys.executable, "-m", "llmgw_cli", "router", "--nats", srv.url, "--prefix", PREFIX]
                argv += ["--port", str(port), "--router-id", f"bench{i}", "--admin-port", "0"]
                procs.append(spawn(argv, work / f"router{i}.log", env))
                urls.append(f"http://127.0.0.1:{port}/v1/chat/completions")
            timeout = aiohttp.ClientTimeout(total=30)
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
                for u in urls:
                    await wait_200(s, u, steady)
                if ARGS.fair:
                    await fair(s, srv.url, urls, flood, steady)
                    return
                # Start on a UTC minute, after the routers have heard each other for a few ticks.
                now = time.time()
                first = (math.floor(now / 60) + 1) * 60
                if first - now < 5 * ARGS.tick_s:
                    first += 60
                print(f"routers up; the run starts at the next UTC minute, in {first - now:.0f}s", flush=True)
                await asyncio.sleep(first - time.time())
                until = first + 60 * ARGS.minutes
                fl: list[tuple[float, int]] = []
                st: list[tuple[float, int]] = []
                await asyncio.gather(
                    drive(s, urls, flood, ARGS.times * ARGS.rpm / 60, until, fl),
                    drive(s, urls, steady, 0.5 * ARGS.rpm / 60, until, st),
                )
        finally:
            for p in procs:
                stop(p)
            srv.stop()
    if not ARGS.fair:
        report(minutes_of(fl, first, ARGS.minutes), minutes_of(st, first, ARGS.minutes))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def fair(s: aiohttp.ClientSession, nats_url: str, urls: list[str], batch: str, light: str) -> None:
    """The light key's wait alone, then under the batch key's flood (both keys' limits lifted first:
    this measures the gate, not the quota)."""
    nc = await nats.connect(nats_url)
    try:
        for name in ("flood", "steady"):
            await update_key(nc, PREFIX, name, limits=None)
    finally:
        await nc.close()
    await asyncio.sleep(2)
    alone: list[float] = []
    sink: list[tuple[float, int]] = []
    await drive(s, urls, light, 1.0, time.time() + ARGS.fair_s, sink, SLOW_BODY, alone)
    loaded: list[float] = []
    flood_out: list[tuple[float, int]] = []
    until = time.time() + ARGS.fair_s
    await asyncio.gather(
        drive(s, urls, batch, ARGS.fair_times * 30.0, until, flood_out, SLOW_BODY),
        drive(s, urls, light, 1.0, until, sink, SLOW_BODY, loaded),
    )
    statuses = Counter(st for _, st in flood_out)
    refused = sum(1 for _, st in sink if st != 200)
    p50a, p99a, p50b, p99b = pct(alone, 0.5), pct(alone, 0.99), pct(loaded, 0.5), pct(loaded, 0.99)
    print(
        f"3 routers, {SLOW}: max_concurrency 1 per router, 100 ms engine; flood {ARGS.fair_times:g}x capacity"
    )
    print(
        f"light key alone:      {len(alone)} answers, wait p50 {p50a * 1000:.0f} ms, p99 {p99a * 1000:.0f} ms"
    )
    print(
        f"light key with flood: {len(loaded)} answers, wait p50 {p50b * 1000:.0f} ms, p99 {p99b * 1000:.0f} ms"
    )
    print(
        f"p99 ratio {p99b / p99a:.2f} (goal <= 2); light refused {refused}; flood statuses {dict(statuses)}"
    )
    summary = {"alone_p50": p50a, "alone_p99": p99a, "flood_p50": p50b, "flood_p99": p99b}
    print(json.dumps({**summary, "light_refused": refused, "flood": dict(statuses)}))


def report(flood: list[Counter[int]], steady: list[Counter[int]]) -> None:
    rows = []
    print(f"3 routers, tick {ARGS.tick_s}s, rpm {ARGS.rpm}; flood at {ARGS.times}x, steady at 0.5x")
    print("minute  flood sent  admitted  over %   other statuses   steady sent  refused")
    for m, (f, s) in enumerate(zip(flood, steady, strict=True)):
        admitted = f[200]
        over = 100.0 * (admitted - ARGS.rpm) / ARGS.rpm
        other = {k: v for k, v in f.items() if k not in (200, 429)}
        refused = sum(v for k, v in s.items() if k != 200)
        rows.append(
            {
                "minute": m,
                "flood_sent": sum(f.values()),
                "flood_admitted": admitted,
                "over_pct": round(over, 2),
                "flood_other": other,
                "steady_sent": sum(s.values()),
                "steady_refused": refused,
                "steady_statuses": dict(s),
            }
        )
        print(
            f"{m:6d}  {sum(f.values()):10d}  {admitted:8d}  {over:6.2f}   {other or '-'!s:15s}  "
            f"{sum(s.values()):11d}  {refused:7d}"
        )
    worst = max(r["over_pct"] for r in rows) if rows else 0.0
    never = all(r["steady_refused"] == 0 for r in rows)
    print(
        f"worst over-admission {worst:.2f}% of the limit per minute (goal <= 2%); steady never refused: {never}"
    )
    print(json.dumps({"rpm": ARGS.rpm, "tick_s": ARGS.tick_s, "times": ARGS.times, "minutes": rows}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=int, default=2)
    ap.add_argument("--rpm", type=int, default=600, help="both keys' requests-per-minute limit")
    ap.add_argument("--times", type=float, default=10.0, help="flood's rate as a multiple of its limit")
    ap.add_argument("--tick-s", type=float, default=1.0, help="the routers' tick")
    ap.add_argument("--fair", action="store_true", help="measure fair queueing instead (see above)")
    ap.add_argument("--fair-s", type=float, default=20.0, help="--fair: seconds of each phase")
    ap.add_argument("--fair-times", type=float, default=20.0, help="--fair: the flood, x capacity")
    ARGS = ap.parse_args()
    asyncio.run(main())
