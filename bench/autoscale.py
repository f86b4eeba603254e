"""Replicas that follow the load (issue 21): a load step from 1x to 4x and back, with and without it.

Boots real processes (the chaos suite's harness, ``tests/chaos/chaos_harness.py``): a nats-server, a
control plane, a router and one agent with 8 simulated cards. One sim model whose engine takes
``--startup`` seconds to load and serves ``--slots`` requests at a time at ``--tokens-per-s`` each.
Open-loop Poisson arrivals (seeded), every request a stream of ``--max-tokens`` tokens:

- base ``--base`` s at 1x (``--load`` of one replica's capacity), step ``--step`` s at 4x, back ``--back``
  s at 1x. The model follows ``in_flight_per_replica: --target`` between 1 and ``--max`` replicas.
- ``--compare`` runs the same trace's base and first ``--compare-step`` s of the step again with the
  count fixed at 1 (no autoscaling), for the TTFT next to it.

Reported: seconds from the step to the first added replica serving; TTFT (first SSE byte at the client)
p50/p99 in the step's first ``--compare-step`` s and over the whole step; 429/503 and other failures
(goal 0: requests are held, never refused); replica-minutes (every placed replica, starting ones too,
sampled each second) against an oracle that knows the trace and starts replicas instantly (goal within
1.5x); scale events during the steady part of the step, after ``--settle`` s (goal 0).

    .venv/bin/python bench/autoscale.py                        # ~7 min
    .venv/bin/python bench/autoscale.py --compare              # ~9 min
    .venv/bin/python bench/autoscale.py --step 700 --settle 100 --json out.json   # 10 min steady
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "chaos"))

from chaos_bus import BusView  # noqa: E402
from chaos_harness import AGGRESSIVE, ChaosCluster  # noqa: E402
from chaos_waits import mint_key, wait_endpoints  # noqa: E402

CARD = "H100-80GB"
MODEL = "chat"
SCALE_KINDS = ("model.scaled_up", "model.scaled_down")


# ---------------------------------------------------------------- trace and oracle (pure)


def service_s(args: argparse.Namespace) -> float:
    """One request's time on a slot: first token after ttft, then one per 1/tokens_per_s."""
    return float(args.ttft_ms) / 1000.0 + float(args.max_tokens) / float(args.tokens_per_s)


def capacity_rps(args: argparse.Namespace) -> float:
    """What one replica serves a second with every slot busy."""
    return float(args.slots) / service_s(args)


def phases(args: argparse.Namespace) -> list[tuple[float, float]]:
    """(duration s, arrivals per second) per phase: base, step (4x), back."""
    base = args.load * capacity_rps(args)
    return [(args.base, base), (args.step, 4 * base), (args.back, base)]


def make_trace(plan: list[tuple[float, float]], seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process whose rate is each phase's."""
    rng = random.Random(seed)
    out: list[float] = []
    t0 = 0.0
    for dur, rate in plan:
        t = t0
        while True:
            t += rng.expovariate(rate)
            if t >= t0 + dur:
                break
            out.append(round(t, 4))
        t0 += dur
    return out


def oracle_replica_minutes(plan: list[tuple[float, float]], args: argparse.Namespace) -> float:
    """An oracle that knows the trace and starts a replica the moment it is needed: per phase, the
    fewest replicas keeping the target (Little: in flight = rate x service time), at least one."""
    total = 0.0
    for dur, rate in plan:
        n = max(1, math.ceil(rate * service_s(args) / args.target - 1e-9))
        total += min(n, args.max) * dur
    return total / 60.0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def catalog(args: argparse.Namespace, autoscale: bool) -> str:
    follow = (
        f"max_replicas: {args.max}, target: {{in_flight_per_replica: {args.target}}}, "
        f"up_after: {args.up_after}s, down_after: {args.down_after}s, "
        if autoscale
        else ""
    )
    return (
        "models:\n"
        f"  - {{name: {MODEL}, engine: sim, gpu_class: {CARD}, replicas: 1, {follow}"
        f"startup_timeout_s: {args.startup * 6 + 30:g}, "
        f"options: {{startup_s: {args.startup}, ttft_ms: {args.ttft_ms}, tokens_per_s: {args.tokens_per_s}, "
        f"slots: {args.slots}}}}}\n"
    )


# ---------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True)
class Sent:
    at: float  # offset from the run's start
    status: int  # 0: no HTTP answer
    ttft: float | None  # first SSE data line, from the send
    ok: bool


@dataclass
class Result:
    autoscale: bool
    requests: int = 0
    ok: int = 0
    status_429: int = 0
    status_503: int = 0
    other_failures: int = 0
    first_added_serving_s: float = float("nan")
    ttft_p50_step_head_s: float = float("nan")
    ttft_p99_step_head_s: float = float("nan")
    ttft_p50_step_s: float = float("nan")
    ttft_p99_step_s: float = float("nan")
    replica_minutes: float = 0.0
    oracle_replica_minutes: float = 0.0
    vs_oracle: float = float("nan")
    max_replicas_seen: int = 0
    steady_window_s: float = 0.0
    scale_events_steady: int = 0
    scale_events: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def _one(http: httpx.AsyncClient, base: str, key: str, args: argparse.Namespace, t0: float) -> Sent:
    start = time.monotonic()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "bench"}],
        "max_tokens": args.max_tokens,
        "stream": True,
    }
    ttft: float | None = None
    try:
        async with http.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            if r.status_code != 200:
                await r.aread()
                return Sent(start - t0, r.status_code, None, False)
            done = False
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.monotonic() - start
                if line.strip() == "data: [DONE]":
                    done = True
            return Sent(start - t0, 200, ttft, done)
    except httpx.HTTPError:
        return Sent(start - t0, 0, ttft, False)


async def _watch(
    view: BusView, t0: float, until: asyncio.Event, samples: list[tuple[float, int, int]]
) -> None:
    """Each second: (offset, replicas placed, endpoints serving)."""
    while not until.is_set():
        with contextlib.suppress(Exception):
            recs = await view.records()
            ep = await view.endpoints()
            serving = len(ep.endpoints.get(MODEL, ())) if ep is not None else 0
            samples.append((time.monotonic() - t0, len(recs), serving))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(until.wait(), timeout=1.0)


async def _drive(
    cluster: ChaosCluster, key: str, trace: list[float], args: argparse.Namespace
) -> tuple[list[Sent], list[tuple[float, int, int]], list[tuple[float, str, str]], float]:
    view = await BusView.connect(cluster.nats_url, cluster.prefix)
    samples: list[tuple[float, int, int]] = []
    try:
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:
            t0 = time.monotonic()
            wall0 = time.time()
            stop = asyncio.Event()
            watcher = asyncio.create_task(_watch(view, t0, stop, samples))
            tasks = []
            for at in trace:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                tasks.append(asyncio.create_task(_one(http, cluster.router_url(), key, args, t0)))
            sent = await asyncio.gather(*tasks)
            stop.set()
            await watcher
        events = [
            (e.time - wall0, e.kind, e.summary)
            for e in await view.model_events(MODEL)
            if e.kind in SCALE_KINDS
        ]
        return list(sent), samples, events, wall0
    finally:
        await view.close()


def run(args: argparse.Namespace, autoscale: bool) -> Result:
    plan = phases(args)
    if not autoscale:
        plan = [plan[0], (args.compare_step, plan[1][1])]
    trace = make_trace(plan, args.seed)
    root = Path(tempfile.mkdtemp(prefix="llmgw-autoscale-"))
    cluster = ChaosCluster(root, settings=dict(AGGRESSIVE), catalog=catalog(args, autoscale))
    try:
        cluster.start_nats()
        cluster.start_controlplane()
        cluster.start_router()
        cluster.start_agent("n1", gpus=f"8x{CARD}")
        key = mint_key(cluster)
        cluster.wait_router()
        wait_endpoints(cluster, MODEL, 1, timeout=args.startup * 6 + 60)
        sent, samples, events, _ = asyncio.run(_drive(cluster, key, trace, args))
    finally:
        cluster.close()
    t_step, t_back = args.base, args.base + (args.step if autoscale else args.compare_step)
    head = [s.ttft for s in sent if t_step <= s.at < t_step + args.compare_step and s.ttft is not None]
    step = [s.ttft for s in sent if t_step <= s.at < t_back and s.ttft is not None]
    res = Result(
        autoscale=autoscale,
        requests=len(sent),
        ok=sum(1 for s in sent if s.ok),
        status_429=sum(1 for s in sent if s.status == 429),
        status_503=sum(1 for s in sent if s.status == 503),
        ttft_p50_step_head_s=round(percentile(head, 0.5), 3),
        ttft_p99_step_head_s=round(percentile(head, 0.99), 3),
        ttft_p50_step_s=round(percentile(step, 0.5), 3),
        ttft_p99_step_s=round(percentile(step, 0.99), 3),
    )
    res.other_failures = res.requests - res.ok - res.status_429 - res.status_503
    added = [t for t, _, serving in samples if t >= t_step and serving > 1]
    res.first_added_serving_s = round(added[0] - t_step, 1) if added else float("nan")
    # Replica-minutes: each sample holds for the second to the next.
    for (t, n, _), (t2, _, _) in itertools.pairwise(samples):
        res.replica_minutes += n * (t2 - t) / 60.0
    res.replica_minutes = round(res.replica_minutes, 2)
    res.max_replicas_seen = max((n for _, n, _ in samples), default=0)
    res.oracle_replica_minutes = round(oracle_replica_minutes(plan, args), 2)
    if res.oracle_replica_minutes:
        res.vs_oracle = round(res.replica_minutes / res.oracle_replica_minutes, 2)
    steady_from = t_step + args.settle
    res.steady_window_s = max(0.0, t_back - steady_from) if autoscale else 0.0
    res.scale_events = [f"{t:7.1f}s {kind}: {summary}" for t, kind, summary in events]
    res.scale_events_steady = sum(1 for t, _, _ in events if steady_from <= t < t_back)
    res.errors = [f"{s.at:.1f}s status {s.status}" for s in sent if not s.ok][:10]
    return res


def show(r: Result) -> str:
    label = "with autoscaling" if r.autoscale else "without (1 replica)"
    lines = [
        f"{label}: {r.requests} requests, {r.ok} ok, {r.status_429} x 429, {r.status_503} x 503, "
        f"{r.other_failures} other failures",
        f"  TTFT in the step's first part p50 {r.ttft_p50_step_head_s}s p99 {r.ttft_p99_step_head_s}s; "
        f"whole step p50 {r.ttft_p50_step_s}s p99 {r.ttft_p99_step_s}s",
    ]
    if r.autoscale:
        lines += [
            f"  first added replica serving {r.first_added_serving_s}s after the step; most replicas "
            f"{r.max_replicas_seen}",
            f"  replica-minutes {r.replica_minutes} vs oracle {r.oracle_replica_minutes}: {r.vs_oracle}x",
            f"  scale events in {r.steady_window_s:.0f}s of steady load: {r.scale_events_steady}",
        ]
        lines += [f"    {e}" for e in r.scale_events]
    lines += [f"  failed: {e}" for e in r.errors]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=float, default=40.0, help="seconds at 1x before the step")
    ap.add_argument("--step", type=float, default=240.0, help="seconds at 4x")
    ap.add_argument("--back", type=float, default=200.0, help="seconds at 1x after the step")
    ap.add_argument("--load", type=float, default=0.6, help="1x as a share of one replica's capacity")
    ap.add_argument("--startup", type=float, default=10.0, help="the sim engine's own load time (s)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens-per-s", type=float, default=20.0, help="per slot")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--target", type=float, default=3.0, help="in_flight_per_replica")
    ap.add_argument("--max", type=int, default=6, help="max_replicas")
    ap.add_argument("--up-after", type=float, default=10.0)
    ap.add_argument("--down-after", type=float, default=40.0)
    ap.add_argument("--settle", type=float, default=140.0, help="step seconds before 'steady' starts")
    ap.add_argument("--compare", action="store_true", help="also run without autoscaling")
    ap.add_argument("--compare-step", type=float, default=60.0, help="step seconds compared")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    print(
        f"one replica: {args.slots} slots x {service_s(args):.2f}s = {capacity_rps(args):.2f} req/s; "
        f"1x = {args.load * capacity_rps(args):.2f} req/s, 4x = {4 * args.load * capacity_rps(args):.2f} req/s"
    )
    results = [run(args, autoscale=True)]
    print(show(results[0]), flush=True)
    if args.compare:
        results.append(run(args, autoscale=False))
        print(show(results[1]))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
