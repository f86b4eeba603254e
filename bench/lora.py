"""LoRA adapters at scale (issue 33): many adapters over a few replicas of their base, Zipf popularity.

Boots real processes (the chaos suite's harness, ``tests/chaos/chaos_harness.py``): a nats-server, a
control plane, a router and one agent with ``--cards`` simulated cards, each holding one replica of the
base (``max_loras`` adapters a replica holds); the simulated engines load an adapter in ``--load``
seconds, as vLLM's runtime API does. ``--adapters`` adapters of that base are in the catalog. A seeded
open-loop trace (Poisson arrivals at ``--rate``, Zipf popularity over the adapters, exponent ``--zipf``)
is replayed in real time through the router, every request streamed with the adapter's name as its
``model``.

A request is *cold* when no replica's load report listed its adapter when it was sent: the router holds
it, asks the control plane (a wake by the adapter's name), the control plane asks a replica to load it
(letting go its least recently used adapter that has no request), the agent loads it through the engine,
and its next load report releases the request.

Reported, with the issue's goals: failed requests (0), a cold adapter's time to first token p99 against
the load time (at most load + 1 s), cards used per adapter (at most 1/10 of one replica), and the loads
and unloads the control plane asked for (`ctl models`).

    .venv/bin/python bench/lora.py                       # 50 adapters, 2 replicas, max_loras 4, ~2 min
    .venv/bin/python bench/lora.py --requests 600 --rate 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
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

from chaos_harness import AGGRESSIVE, ChaosCluster  # noqa: E402
from chaos_waits import mint_key  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402

from llmgw_common.codec import DecodeError, decode  # noqa: E402
from llmgw_common.messages import Assignment, LoadReport  # noqa: E402
from llmgw_common.subjects import Subjects  # noqa: E402
from llmgw_runtime import bus  # noqa: E402
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable  # noqa: E402
from llmgw_runtime.settings import BusSettings  # noqa: E402

CARD = "H100-80GB"


# ---------------------------------------------------------------- trace (pure)


def make_trace(adapters: int, requests: int, rate: float, zipf: float, seed: int) -> list[tuple[float, str]]:
    """(time offset, adapter) pairs: Poisson arrivals, Zipf popularity (rank r weighs 1/(r+1)^zipf)."""
    rng = random.Random(seed)
    names = [f"lora-{i:02d}" for i in range(adapters)]
    rng.shuffle(names)  # popularity is not the name's order
    weights = [1.0 / (r + 1) ** zipf for r in range(adapters)]
    out: list[tuple[float, str]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        out.append((round(t, 3), rng.choices(names, weights)[0]))
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def catalog(
    adapters: int, replicas: int, max_loras: int, load_s: float, max_cpu_loras: int | None = None
) -> str:
    cpu = f"    max_cpu_loras: {max_cpu_loras}\n" if max_cpu_loras else ""
    base = (
        "models:\n"
        "  - name: base\n"
        "    engine: sim\n"
        f"    gpu_class: {CARD}\n"
        f"    replicas: {replicas}\n"
        f"    max_loras: {max_loras}\n"
        f"{cpu}"
        "    startup_timeout_s: 60\n"
        f"    options: {{startup_s: 0.3, ttft_ms: 20, tokens_per_s: 200, slots: 64, lora_load_s: {load_s}}}\n"
        "adapters:\n"
    )
    return base + "".join(
        f"  - {{name: lora-{i:02d}, base: base, weights: lora-{i:02d}}}\n" for i in range(adapters)
    )


# ---------------------------------------------------------------- the run


@dataclass
class Result:
    adapters: int
    replicas: int
    max_loras: int
    max_cpu_loras: int | None
    requests: int
    load_s: float
    duration_s: float
    ok: int = 0
    failed: int = 0
    cold: int = 0
    cold_ttft_p50_s: float = float("nan")
    cold_ttft_p99_s: float = float("nan")
    cold_goal_s: float = float("nan")
    warm_ttft_p50_s: float = float("nan")
    warm_ttft_p99_s: float = float("nan")
    # Medians over cold requests: sent -> asked of a replica (router + control plane), asked -> reported
    # loaded (agent + engine), reported -> first token (router's release + engine).
    cold_to_assigned_p50_s: float = float("nan")
    cold_to_loaded_p50_s: float = float("nan")
    cold_to_token_p50_s: float = float("nan")
    # The same at p99: where a cold request's tail time goes.
    cold_to_assigned_p99_s: float = float("nan")
    cold_to_loaded_p99_s: float = float("nan")
    cold_to_token_p99_s: float = float("nan")
    cards_per_adapter: float = float("nan")
    loads: int = 0
    unloads: int = 0
    errors: list[str] = field(default_factory=list)


class Tracker:
    """What the bus says of each adapter: asked of a replica (shard 0's assignment, as the control plane
    writes it) and loaded (the agents' load reports), with a future for the next time each becomes so."""

    def __init__(self) -> None:
        self.assigned: dict[str, frozenset[str]] = {}  # node -> adapters its shards 0 ask for
        self.loaded: dict[str, frozenset[str]] = {}  # replica -> adapters reported loaded
        self._waiters: dict[tuple[str, str], list[asyncio.Future[float]]] = {}

    def now_true(self, kind: str, adapter: str) -> bool:
        table = self.assigned if kind == "assigned" else self.loaded
        return any(adapter in s for s in table.values())

    def when(self, kind: str, adapter: str) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        if self.now_true(kind, adapter):
            fut.set_result(time.monotonic())
        else:
            self._waiters.setdefault((kind, adapter), []).append(fut)
        return fut

    def _fire(self, kind: str) -> None:
        now = time.monotonic()
        for (k, adapter), futs in list(self._waiters.items()):
            if k == kind and self.now_true(kind, adapter):
                for f in futs:
                    if not f.done():
                        f.set_result(now)
                del self._waiters[(k, adapter)]

    async def on_load(self, rep: LoadReport, _: Msg) -> None:
        for line in rep.replicas:
            if line.shard == 0:
                self.loaded[line.replica_id] = frozenset(line.adapters)
        self._fire("loaded")

    async def on_assignment(self, msg: Msg) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        try:
            a = decode(msg.data, Assignment)
        except DecodeError:
            return  # a delete marker, or not ours
        self.assigned[node] = frozenset(x.name for sh in a.shards if sh.shard == 0 for x in sh.adapters)
        self._fire("assigned")


class Driver:
    def __init__(self, base: str, key: str, tracker: Tracker) -> None:
        self.base, self.key, self.tracker = base, key, tracker
        self.cold: list[float] = []
        self.warm: list[float] = []
        # Cold requests: sent -> asked of a replica, asked -> reported loaded, reported -> first token.
        self.to_assigned: list[float] = []
        self.to_loaded: list[float] = []
        self.to_token: list[float] = []
        self.ok = 0
        self.errors: list[str] = []

    async def one(self, http: httpx.AsyncClient, adapter: str) -> None:
        t0 = time.monotonic()
        cold = not self.tracker.now_true("loaded", adapter)
        assigned = self.tracker.when("assigned", adapter)
        loaded = self.tracker.when("loaded", adapter)
        try:
            await self._one(http, adapter, t0, cold, assigned, loaded)
        finally:
            assigned.cancel()
            loaded.cancel()

    async def _one(
        self,
        http: httpx.AsyncClient,
        adapter: str,
        t0: float,
        cold: bool,
        assigned: asyncio.Future[float],
        loaded: asyncio.Future[float],
    ) -> None:
        first: float | None = None
        body = {
            "model": adapter,
            "messages": [{"role": "user", "content": f"a question for {adapter}"}],
            "max_tokens": 8,
            "stream": True,
        }
        try:
            async with http.stream(
                "POST",
                f"{self.base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {self.key}"},
                json=body,
            ) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    self.errors.append(f"{adapter}: {r.status_code} {text[:200]}")
                    return
                done = False
                async for line in r.aiter_lines():
                    # ": waking ..." comments while held are not tokens.
                    if line.startswith("data:") and first is None:
                        first = time.monotonic() - t0
                    done = done or line.strip() == "data: [DONE]"
                if not done or first is None:
                    self.errors.append(f"{adapter}: stream ended without [DONE]")
                    return
        except httpx.HTTPError as e:
            self.errors.append(f"{adapter}: {type(e).__name__} {e}")
            return
        self.ok += 1
        (self.cold if cold else self.warm).append(first)
        if cold and assigned.done() and loaded.done():
            a, ld = assigned.result(), loaded.result()
            self.to_assigned.append(a - t0)
            self.to_loaded.append(max(0.0, ld - a))
            self.to_token.append(max(0.0, t0 + first - ld))


async def replay(cluster: ChaosCluster, key: str, trace: list[tuple[float, str]]) -> tuple[Driver, int, int]:
    nc = await bus.connect(BusSettings(nats_urls=[cluster.nats_url], prefix=cluster.prefix), "bench-lora")
    tracker = Tracker()
    subj = Subjects(cluster.prefix)
    sub = await bus.subscribe(
        nc, subj.all_nodes("load"), LoadReport, tracker.on_load, bus.DropLog(logging.getLogger("bench.lora"))
    )
    # A KV put is a message on its stream's subject: heard as written, with no watcher's replay.
    sub_assign = await nc.subscribe(f"$KV.{subj.bucket_assign}.>", cb=tracker.on_assignment)
    try:
        d = Driver(cluster.router_url(), key, tracker)
        async with httpx.AsyncClient(timeout=httpx.Timeout(180.0, connect=10.0)) as http:
            start = time.monotonic()
            tasks = []
            for t, adapter in trace:
                await asyncio.sleep(max(0.0, start + t - time.monotonic()))
                tasks.append(asyncio.create_task(d.one(http, adapter)))
            await asyncio.gather(*tasks)
        models = await CtlClient(nc, cluster.prefix, timeout=10).models()
        loads = sum(a.loads for a in models.adapters)
        unloads = sum(a.unloads for a in models.adapters)
        return d, loads, unloads
    finally:
        await sub.unsubscribe()
        await sub_assign.unsubscribe()
        await nc.close()


async def base_serving(cluster: ChaosCluster, replicas: int, timeout: float = 90.0) -> None:
    nc = await bus.connect(BusSettings(nats_urls=[cluster.nats_url], prefix=cluster.prefix), "bench-lora")
    try:
        ctl = CtlClient(nc, cluster.prefix, timeout=5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ms = await ctl.models()
            except CtlUnavailable:  # the control plane may not lead yet: ask again
                ms = None
            if ms is not None and any(m.name == "base" and m.ready >= replicas for m in ms.models):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the base did not serve {replicas} replicas within {timeout:.0f}s")
    finally:
        await nc.close()


def run(args: argparse.Namespace) -> Result:
    trace = make_trace(args.adapters, args.requests, args.rate, args.zipf, args.seed)
    root = Path(tempfile.mkdtemp(prefix="llmgw-lora-"))
    settings = dict(AGGRESSIVE)
    settings["LLMGW_ADAPTER_MIN_RESIDENCY_S"] = str(args.residency)
    cluster = ChaosCluster(
        root,
        settings=settings,
        catalog=catalog(args.adapters, args.replicas, args.max_loras, args.load, args.max_cpu_loras),
    )
    try:
        cluster.start_nats()
        cluster.start_controlplane()
        cluster.start_router()
        cluster.start_agent("n1", gpus=f"{args.replicas}x{CARD}")
        key = mint_key(cluster)
        cluster.wait_router()
        asyncio.run(base_serving(cluster, args.replicas))
        t_run = time.monotonic()
        d, loads, unloads = asyncio.run(replay(cluster, key, trace))
        duration = time.monotonic() - t_run
    except BaseException:
        print(cluster.diagnostics(), file=sys.stderr)
        raise
    finally:
        cluster.close()
    return Result(
        adapters=args.adapters,
        replicas=args.replicas,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        requests=len(trace),
        load_s=args.load,
        duration_s=round(duration, 1),
        ok=d.ok,
        failed=len(d.errors),
        cold=len(d.cold),
        cold_ttft_p50_s=round(percentile(d.cold, 0.5), 2),
        cold_ttft_p99_s=round(percentile(d.cold, 0.99), 2),
        cold_goal_s=args.load + 1.0,
        warm_ttft_p50_s=round(percentile(d.warm, 0.5), 3),
        warm_ttft_p99_s=round(percentile(d.warm, 0.99), 3),
        cold_to_assigned_p50_s=round(percentile(d.to_assigned, 0.5), 2),
        cold_to_loaded_p50_s=round(percentile(d.to_loaded, 0.5), 2),
        cold_to_token_p50_s=round(percentile(d.to_token, 0.5), 2),
        cold_to_assigned_p99_s=round(percentile(d.to_assigned, 0.99), 2),
        cold_to_loaded_p99_s=round(percentile(d.to_loaded, 0.99), 2),
        cold_to_token_p99_s=round(percentile(d.to_token, 0.99), 2),
        # One card per replica of the base, shared by every adapter.
        cards_per_adapter=round(args.replicas / args.adapters, 3),
        loads=loads,
        unloads=unloads,
        errors=d.errors[:10],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=50)
    ap.add_argument("--replicas", type=int, default=2, help="replicas of the base (one card each)")
    ap.add_argument("--max-loras", type=int, default=4, help="adapters in one batch")
    ap.add_argument(
        "--max-cpu-loras", type=int, help="adapters one replica holds loaded (default: max_loras)"
    )
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    ap.add_argument("--load", type=float, default=1.0, help="the engine's adapter load time (s)")
    ap.add_argument("--residency", type=float, default=5.0, help="adapter_min_residency_s")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    res = run(args)
    print(
        f"{res.adapters} adapters over {res.replicas} replicas (max_loras {res.max_loras}, "
        f"max_cpu_loras {res.max_cpu_loras or res.max_loras}), "
        f"{res.requests} requests in {res.duration_s}s: {res.ok} ok, {res.failed} failed (goal 0)\n"
        f"cold adapter TTFT p50 {res.cold_ttft_p50_s}s p99 {res.cold_ttft_p99_s}s over {res.cold} requests "
        f"(goal p99 <= load {res.load_s}s + 1s = {res.cold_goal_s}s); warm p50 {res.warm_ttft_p50_s}s "
        f"p99 {res.warm_ttft_p99_s}s\n"
        f"cold path p50: asked of a replica after {res.cold_to_assigned_p50_s}s, reported loaded "
        f"{res.cold_to_loaded_p50_s}s later, first token {res.cold_to_token_p50_s}s after that "
        f"(p99: {res.cold_to_assigned_p99_s} / {res.cold_to_loaded_p99_s} / {res.cold_to_token_p99_s}s)\n"
        f"cards per adapter {res.cards_per_adapter} (goal <= 0.1); {res.loads} loads, {res.unloads} unloads"
    )
    for e in res.errors:
        print("  error:", e)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(res), indent=2))


if __name__ == "__main__":
    main()
