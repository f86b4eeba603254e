"""Scale to zero under a replayed trace (issue 13): N models on M cards, wake latency and evictions.

Boots real processes (the chaos suite's harness, ``tests/chaos/chaos_harness.py``): a nats-server, a
control plane, a router and one agent whose M simulated cards each hold one replica; the catalog has N
sim models (``min_replicas: 0``) whose engines take ``--startup`` seconds to load. A seeded trace of
requests (popularity skewed and drifting, so the working set changes) is replayed in real time.

A request for a model without a ready replica is a *wake*. Two ways to send requests:

- ``--via wake`` (default; the control plane's side alone): the bench does what a holding router does:
  it asks the control plane on ``<prefix>.router.<id>.wake``, waits for the model's endpoint, then sends
  the request through the router;
- ``--via router``: the request goes to the router as is, and the router holds it while it wakes the
  model (needs the router's holding, ``llmgw_router.holding``; without it a cold model gets a 503).

Reported: wake latency p50/p99 (request to answer) next to the engine's own start time, the 5xx count
(goal 0), and evictions per hour against an oracle that knows the future (Belady: on a miss with every
card taken, evict the resident model needed furthest ahead; goal: within 2x).

    .venv/bin/python bench/cold_start.py                     # 6 models, 2 cards, 60 requests, ~2 min
    .venv/bin/python bench/cold_start.py --models 8 --cards 3 --requests 120 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from chaos_waits import mint_key  # noqa: E402

from llmgw_common.codec import decode, encode  # noqa: E402
from llmgw_common.router_messages import WakeReply, WakeRequest, WakeState  # noqa: E402
from llmgw_common.subjects import Subjects  # noqa: E402

CARD = "H100-80GB"


# ---------------------------------------------------------------- trace and oracle (pure)


def make_trace(models: int, requests: int, gap_s: float, seed: int) -> list[tuple[float, str]]:
    """(time offset, model) pairs: Zipf-like popularity over a ranking that drifts every tenth request."""
    rng = random.Random(seed)
    names = [f"m{i}" for i in range(models)]
    weights = [1.0 / (r + 1) for r in range(models)]
    out: list[tuple[float, str]] = []
    t = 0.0
    for i in range(requests):
        if i and i % 10 == 0:
            rng.shuffle(names)  # the working set moves
        t += rng.expovariate(1.0 / gap_s)
        out.append((round(t, 3), rng.choices(names, weights)[0]))
    return out


def belady_evictions(trace: list[str], cards: int) -> int:
    """Evictions of the offline optimum: each miss with every card taken evicts the resident model whose
    next request is furthest ahead (never again counts as furthest)."""
    resident: set[str] = set()
    evictions = 0
    for i, m in enumerate(trace):
        if m in resident:
            continue
        if len(resident) >= cards:

            def next_use(x: str, i: int = i) -> int:
                for j in range(i + 1, len(trace)):
                    if trace[j] == x:
                        return j
                return len(trace) + 1

            resident.discard(max(sorted(resident), key=next_use))
            evictions += 1
        resident.add(m)
    return evictions


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# ---------------------------------------------------------------- the run


def catalog(models: int, startup_s: float, idle_after: str) -> str:
    return "models:\n" + "".join(
        f"  - {{name: m{i}, engine: sim, gpu_class: {CARD}, replicas: 1, min_replicas: 0, "
        f"idle_after: {idle_after}, options: {{startup_s: {startup_s}, ttft_ms: 20, tokens_per_s: 400}}}}\n"
        for i in range(models)
    )


@dataclass
class Result:
    models: int
    cards: int
    requests: int
    via: str
    engine_start_s: float
    duration_s: float
    ok: int = 0
    status_5xx: int = 0
    other_errors: int = 0
    wakes: int = 0
    wake_p50_s: float = float("nan")
    wake_p99_s: float = float("nan")
    warm_p50_s: float = float("nan")
    evictions: int = 0
    evictions_per_hour: float = 0.0
    oracle_evictions: int = 0
    oracle_per_hour: float = 0.0
    vs_oracle: float = float("nan")
    errors: list[str] = field(default_factory=list)


class Driver:
    def __init__(self, view: BusView, base: str, key: str, prefix: str, via: str) -> None:
        self.view, self.base, self.key, self.prefix, self.via = view, base, key, prefix, via
        self.wake_lat: list[float] = []
        self.warm_lat: list[float] = []
        self.codes: list[int] = []
        self.errors: list[str] = []
        self._waking: dict[str, asyncio.Future[None]] = {}

    async def _serving(self, model: str) -> bool:
        ep = await self.view.endpoints()
        return ep is not None and bool(ep.endpoints.get(model))

    async def _wake(self, model: str, timeout: float = 120.0) -> None:
        """As a holding router does: one wake per model at a time, re-asked until the model serves."""
        subj = Subjects(self.prefix).wake("bench")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._serving(model):
                return
            req = WakeRequest(model=model, router="bench", sent_at=time.time())
            try:
                msg = await self.view.nc.request(subj, encode(req), timeout=2)
                reply = decode(msg.data, WakeReply)
                if reply.state is WakeState.REFUSED:
                    raise RuntimeError(f"wake of {model} refused: {reply.reason}")
            except TimeoutError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{model} not serving {timeout:.0f}s after its wake")

    async def one(self, http: httpx.AsyncClient, model: str) -> None:
        t0 = time.monotonic()
        cold = not await self._serving(model)
        try:
            if cold and self.via == "wake":
                fut = self._waking.get(model)
                if fut is None:
                    fut = asyncio.ensure_future(self._wake(model))
                    self._waking[model] = fut
                    fut.add_done_callback(lambda _f, m=model: self._waking.pop(m, None))
                await asyncio.shield(fut)
            r = await http.post(
                f"{self.base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {self.key}"},
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            self.codes.append(r.status_code)
            if r.status_code >= 400:
                self.errors.append(f"{model}: {r.status_code} {r.text[:200]}")
        except (httpx.HTTPError, RuntimeError) as e:
            self.codes.append(0)
            self.errors.append(f"{model}: {e}")
            return
        (self.wake_lat if cold else self.warm_lat).append(time.monotonic() - t0)


async def replay(
    cluster: ChaosCluster, key: str, trace: list[tuple[float, str]], via: str
) -> tuple[Driver, int]:
    """Replay ``trace`` in real time; the driver's tallies and the evictions in the events stream."""
    view = await BusView.connect(cluster.nats_url, cluster.prefix)
    try:
        d = Driver(view, cluster.router_url(), key, cluster.prefix, via)
        async with httpx.AsyncClient(timeout=180.0) as http:
            start = time.monotonic()
            tasks = []
            for t, model in trace:
                await asyncio.sleep(max(0.0, start + t - time.monotonic()))
                tasks.append(asyncio.create_task(d.one(http, model)))
            await asyncio.gather(*tasks)
        evicted = 0
        for m in sorted({m for _, m in trace}):
            evicted += sum(1 for e in await view.model_events(m) if e.kind == "model.evicted")
        return d, evicted
    finally:
        await view.close()


def run(args: argparse.Namespace) -> Result:
    trace = make_trace(args.models, args.requests, args.gap, args.seed)
    root = Path(tempfile.mkdtemp(prefix="llmgw-cold-start-"))
    settings = dict(AGGRESSIVE)
    settings["LLMGW_EVICTION_MIN_RESIDENCY_S"] = str(args.residency)
    cluster = ChaosCluster(
        root, settings=settings, catalog=catalog(args.models, args.startup, args.idle_after)
    )
    try:
        cluster.start_nats()
        cluster.start_controlplane()
        cluster.start_router()
        cluster.start_agent("n1", gpus=f"{args.cards}x{CARD}")
        key = mint_key(cluster)
        cluster.wait_router()
        time.sleep(float(AGGRESSIVE["LLMGW_SETTLE_S"]) + 1.0)  # the control plane's settling window
        t_run = time.monotonic()
        d, evicted = asyncio.run(replay(cluster, key, trace, args.via))
        duration = time.monotonic() - t_run
    finally:
        cluster.close()
    hours = max(duration, 1e-9) / 3600
    oracle = belady_evictions([m for _, m in trace], args.cards)
    return Result(
        models=args.models,
        cards=args.cards,
        requests=len(trace),
        via=args.via,
        engine_start_s=args.startup,
        duration_s=round(duration, 1),
        ok=sum(1 for c in d.codes if 200 <= c < 300),
        status_5xx=sum(1 for c in d.codes if c >= 500),
        other_errors=sum(1 for c in d.codes if c == 0 or 400 <= c < 500),
        wakes=len(d.wake_lat),
        wake_p50_s=round(percentile(d.wake_lat, 0.5), 2),
        wake_p99_s=round(percentile(d.wake_lat, 0.99), 2),
        warm_p50_s=round(percentile(d.warm_lat, 0.5), 3),
        evictions=evicted,
        evictions_per_hour=round(evicted / hours, 1),
        oracle_evictions=oracle,
        oracle_per_hour=round(oracle / hours, 1),
        vs_oracle=round(evicted / oracle, 2) if oracle else float("nan"),
        errors=d.errors[:10],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=6)
    ap.add_argument("--cards", type=int, default=2)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--gap", type=float, default=1.5, help="mean seconds between requests")
    ap.add_argument("--startup", type=float, default=2.0, help="the sim engine's own load time (s)")
    ap.add_argument(
        "--idle-after", default="10m", help="models' idle_after (longer than the run: evictions only)"
    )
    ap.add_argument("--residency", type=float, default=5.0, help="eviction_min_residency_s")
    ap.add_argument("--via", choices=("wake", "router"), default="wake")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    res = run(args)
    print(
        f"{res.models} models on {res.cards} cards, {res.requests} requests via {res.via} in {res.duration_s}s: "
        f"{res.ok} ok, {res.status_5xx} 5xx, {res.other_errors} other errors\n"
        f"wake latency p50 {res.wake_p50_s}s p99 {res.wake_p99_s}s over {res.wakes} wakes "
        f"(engine's own start {res.engine_start_s}s; warm p50 {res.warm_p50_s}s)\n"
        f"evictions {res.evictions} ({res.evictions_per_hour}/h) vs oracle {res.oracle_evictions} "
        f"({res.oracle_per_hour}/h): {res.vs_oracle}x"
    )
    for e in res.errors:
        print("  error:", e)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(res), indent=2))


if __name__ == "__main__":
    main()
