"""Every shipped alert rule fires in a real Prometheus, reaches a real Alertmanager, and resolves once its
fault is gone; every query of the Grafana dashboard runs against the same Prometheus (issue 34).

The cluster is real processes (tests/chaos/chaos_harness.py): nats-server, a control plane, two
routers, a notifier, agents with simulated GPUs running simulated engines. Debian's Prometheus 2.42
scrapes every service's /metrics each second with deploy/prometheus/*.yml loaded, and sends to
Debian's Alertmanager 0.25, whose API the test polls.

The rule file is REWRITTEN for the test (promstack.rules_for_test, checked in test_alerts_static.py):
every ``for:`` becomes 2 s, every range and offset 20 s, and the two thresholds that are durations
become short ones (a request held over 5 s, not 30; a webhook backlog over 3 s, not 300). Metrics,
labels, aggregations and functions are the shipped text, so a rule that names a metric wrongly, or
aggregates away the label it reports, fails here.

Phase 1 makes these faults at once (none disturbs another's alert):
  - agent n3 frozen (SIGSTOP)                        LlmgwNodeLost
  - router-2 frozen                                  LlmgwServiceDown{job="llmgw-router"}
  - router-3 started cut from the bus (from boot)    LlmgwRouterWithoutRouting; mended by its bus
  - every other reconcile pass raises               LlmgwControlPlaneFailingPasses
  - model "big" needs a B200 no node has (from boot) LlmgwModelUnplaceable; removed by a B200 node
  - the watched model "judge" (one replica, 12 s to start) loses its engine mid-stream, requests
    arrive while it restarts                         LlmgwWatchedModelDown, LlmgwStreamsNotMigrated,
                                                     LlmgwRequestsHeldLong
  - webhook A refuses until the backlog alert       LlmgwWebhookBacklog{target=A}
  - webhook B refuses until its alerts are given up LlmgwWebhookBacklog{target=B}, LlmgwWebhookGaveUp
  - the watched model "slow" (one slot) kept busy by a long stream: its probes wait past their budget
    while it has a ready replica                     LlmgwProbeOverBudget{model=slow}; mended by ending
                                                     the stream
  - router-3, once it routes, cut from the bus again and asked: its usage waits unwritten
                                                     LlmgwUsageLedgerBehind{instance=router-3}; mended
                                                     by its bus
Phase 2, alone (the control plane's bus is what the others need):
  - the control plane cut from the bus (a TCP proxy) LlmgwNoLeader (0 leaders)
  - the control plane frozen                         LlmgwNoLeader (none answering), LlmgwServiceDown
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from aiohttp import web

from llmgw_common.messages import ClusterSettings, KeyLimits, ShardState, Webhook
from llmgw_notifier.targets import target_id
from llmgw_runtime.apikeys import create_key
from tests.alerts.dashboard import dashboards, queries
from tests.alerts.promstack import (
    MISSING,
    WHY_MISSING,
    AlertLog,
    Expect,
    PromStack,
    query,
    rule_alerts,
    rule_files,
    rules_for_test,
    targets_up,
)
from tests.alerts.tcpcut import TcpCut
from tests.chaos.chaos_bus import BUS_ERRORS, BusView
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster, Proc
from tests.chaos.chaos_waits import mint_key, wait_endpoints
from tests.http_clients import async_client
from tests.kit.poll import eventually
from tests.kit.ports import free_port
from tests.kit.promtext import value

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.xdist_group("alerts"),
    pytest.mark.skipif(bool(MISSING), reason=WHY_MISSING),
]

JUDGE_START_S = 12.0
CATALOG = f"""\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 2
    startup_timeout_s: 30
    options: {{startup_s: 0.3, ttft_ms: 15, tokens_per_s: 300, slots: 64}}
  - name: judge
    engine: vllm
    gpu_class: L4-24GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: 60
    queue_timeout_s: 60
    watch: {{probe_every: 2s, budget: 1s, failures: 2}}
    options: {{startup_s: {JUDGE_START_S}, ttft_ms: 10, tokens_per_s: 20, slots: 16}}
  - name: slow
    engine: vllm
    gpu_class: L4-24GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: 30
    watch: {{probe_every: 1s, budget: 1s, failures: 2}}
    options: {{startup_s: 0.3, ttft_ms: 10, tokens_per_s: 20, slots: 1}}
  - name: big
    engine: vllm
    gpu_class: B200-180GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: 30
    options: {{startup_s: 0.3, ttft_ms: 15, tokens_per_s: 300, slots: 8}}
"""
LAUNCHER = Path(__file__).resolve().parent / "launcher.py"
LEDGER_AGE = "llmgw_router_usage_ledger_oldest_unwritten_seconds"
# Whole phases: each alert fires within seconds of its fault and resolves within the 20 s windows.
PHASE_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- faults


class Receiver:
    """A webhook receiver that refuses (HTTP 503) until told to take."""

    def __init__(self) -> None:
        self.taking = True
        self.got = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        if not self.taking:
            return web.Response(status=503)
        self.got += 1
        return web.Response(status=204)

    async def start(self, path: str) -> Receiver:
        app = web.Application()
        app.router.add_post(path, self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}{path}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class Fault:
    """Something broken, the alerts it must raise, and how it is mended (None: it mends itself)."""

    name: str
    expect: list[Expect]
    mend: Callable[[], Awaitable[None]] | None = None
    mended: bool = False


def _signal(p: Proc, sig: signal.Signals) -> Callable[[], Awaitable[None]]:
    async def send() -> None:
        p.signal(sig)

    return send


@dataclass
class Run:
    cluster: ChaosCluster
    log: AlertLog
    http: httpx.AsyncClient
    prom: str
    t0: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(f"{time.monotonic() - self.t0:6.1f}s {line}")

    def report(self) -> str:
        return "\n".join(self.lines) + f"\nAlertmanager holds now: {self.log.names_now()}"

    async def phase(
        self, faults: list[Fault], started: float, doing: Sequence[asyncio.Task[None]] = ()
    ) -> None:
        """Wait until each fault's alerts were all held by Alertmanager (then mend it), and until every
        one of them is no longer held. ``doing``: the test's own tasks making faults; one that failed
        fails the phase at once, with its own error."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while True:
            for task in doing:
                if task.done() and task.exception() is not None:
                    await task
            pending = []
            for f in faults:
                fired = [self.log.fired_at(e, started) for e in f.expect]
                if all(t is not None for t in fired) and not f.mended:
                    f.mended = True
                    self.say(f"{f.name}: {', '.join(map(str, f.expect))} held by Alertmanager; mending")
                    if f.mend is not None:
                        await f.mend()
                for e, t in zip(f.expect, fired, strict=True):
                    if t is None:
                        pending.append(f"{e} ({f.name}) never held")
                    elif self.log.resolved_at(e, started) is None:
                        pending.append(f"{e} ({f.name}) not resolved")
            if not pending:
                for f in faults:
                    for e in f.expect:
                        at, gone = self.log.fired_at(e, started), self.log.resolved_at(e, started)
                        assert at is not None and gone is not None
                        self.say(f"  {e}: held {at - started:.1f}s after the faults, for {gone - at:.1f}s")
                return
            assert time.monotonic() < deadline, f"after {PHASE_TIMEOUT_S:.0f}s: {pending}\n{self.report()}"
            await asyncio.sleep(0.25)


# ---------------------------------------------------------------- the test


async def test_every_shipped_alert_fires_reaches_alertmanager_and_resolves(tmp_path: Path) -> None:
    c = ChaosCluster(tmp_path / "cluster", prefix="alerts", catalog=CATALOG)
    c.settings = {
        **AGGRESSIVE,
        "LLMGW_BACKOFF_BASE_S": "0.5",
        "LLMGW_GROUP_WINDOW_S": "0.5",
        # The notifier: a webhook that refuses is given up after 10 s, retried each second meanwhile.
        "LLMGW_RETRY_FOR_S": "10",
        "LLMGW_RETRY_BASE_S": "0.5",
        "LLMGW_RETRY_MAX_S": "1",
        "LLMGW_HTTP_TIMEOUT_S": "2",
    }
    trigger = tmp_path / "fault-every-other-pass-raises"
    ports = {name: free_port() for name in ("cp", "router", "router-2", "router-3", "notifier")}
    stack: PromStack | None = None
    cut: TcpCut | None = None
    cut3: TcpCut | None = None  # router-3's way to the bus: cut from its start
    receivers = [Receiver(), Receiver()]
    watcher: asyncio.Task[None] | None = None
    boot_hold: asyncio.Task[httpx.Response] | None = None
    judge: asyncio.Task[None] | None = None
    ledger: asyncio.Task[None] | None = None
    filler: asyncio.Task[None] | None = None
    http = async_client(timeout=10)
    try:
        await asyncio.to_thread(c.start_nats)
        cut = TcpCut(c.nats_port)
        await cut.restore()
        cut3 = TcpCut(c.nats_port)
        _start_cp(c, _via(trigger, cut.url), ports["cp"])
        for r in ("router", "router-2"):
            c.start_router(r, admin_port=ports[r])
        c.start_router("router-3", admin_port=ports["router-3"], launcher=_via(trigger, cut3.url))
        for node, gpus in (
            ("n1", "1xH100-80GB"),
            ("n2", "1xH100-80GB"),
            ("n3", "1xA10-24GB"),
            ("n4", "2xL4-24GB"),  # judge and slow
        ):
            c.start_agent(node, gpus)
        key = await asyncio.to_thread(mint_key, c)
        probe_key = await asyncio.to_thread(mint_key, c, "probes")
        c._proc(
            "notifier",
            ["notifier", "--router-url", c.router_url(), "--probe-key", probe_key, "--group-window", "0.5"],
            {"LLMGW_METRICS_PORT": str(ports["notifier"])},
        )
        await c.wait_router_async("router")
        await c.wait_router_async("router-2")
        # A request held while judge's first replica starts, for 2 s (the client gives up; under the
        # test's 5 s): the router's hold histogram for judge exists from here on. A histogram child born
        # with its first observations is one sample to rate(), which sees no increase in it; an
        # operator's Prometheus has seen earlier holds.
        await eventually(
            lambda: _listed(http, c.router_url(), key, "judge"),
            timeout=30,
            every=0.2,
            what="judge in /v1/models",
        )
        boot_hold = asyncio.create_task(_chat(http, c.router_url(), key, "judge", timeout=2))

        rules = tmp_path / "rules"
        rules.mkdir()
        for f in rule_files():
            (rules / f.name).write_text(rules_for_test(f.read_text()))
        jobs = {
            "llmgw-controlplane": [f"127.0.0.1:{ports['cp']}"],
            "llmgw-router": [f"127.0.0.1:{ports[r]}" for r in ("router", "router-2", "router-3")],
            "llmgw-notifier": [f"127.0.0.1:{ports['notifier']}"],
        }
        stack = PromStack(tmp_path / "prom", jobs, rules / "*.yml")
        await asyncio.to_thread(stack.start)
        prom, am = stack.prometheus.url, stack.alertmanager.url
        log = AlertLog(am)
        watcher = asyncio.create_task(log.run(http))
        run = Run(c, log, http, prom)

        await asyncio.to_thread(wait_endpoints, c, "chat", 2, 90)
        await asyncio.to_thread(wait_endpoints, c, "judge", 1, 90)
        await asyncio.to_thread(wait_endpoints, c, "slow", 1, 90)
        with pytest.raises(httpx.TimeoutException):
            await boot_hold
        run.say("cluster serving chat, judge and slow")

        # Every service scraped, and nothing firing but what the cluster is built with.
        async def all_up() -> dict[str, str] | None:
            up = await targets_up(http, prom)
            return up if len(up) == 5 and set(up.values()) == {"up"} else None

        await eventually(all_up, timeout=30, every=0.5, what="Prometheus to scrape every service")
        hold_series = await query(http, prom, 'llmgw_router_hold_seconds_count{model="judge"}')
        assert hold_series, "the boot request to judge was not held"
        await asyncio.sleep(2)  # evaluations that saw it
        unplaceable = Expect("LlmgwModelUnplaceable")
        await eventually(
            lambda: log.held_now(unplaceable),
            timeout=30,
            every=0.25,
            what=f"{unplaceable} (model big, from boot)",
        )
        # Requests held while judge first started (the boot request, the notifier's probes) may raise
        # LlmgwRequestsHeldLong at the test's 5 s: it resolves once they leave the 20 s window. Quiet is
        # Prometheus holding nothing else either, pending included (a hold that just ended).
        quiet = [
            "LlmgwModelUnplaceable{'job': 'llmgw-controlplane'}",
            "LlmgwRouterWithoutRouting{'job': 'llmgw-router'}",
        ]

        async def only_unplaceable() -> bool:
            rules_say = await rule_alerts(http, prom)
            firing = ["LlmgwModelUnplaceable firing", "LlmgwRouterWithoutRouting firing"]
            return rules_say == firing and log.names_now() == quiet

        await eventually(only_unplaceable, timeout=60, every=0.25, what=f"only {quiet} pending or firing")
        await asyncio.sleep(3)  # a few evaluations more
        assert await only_unplaceable(), f"{await rule_alerts(http, prom)}\n{run.report()}"

        view = await BusView.connect(c.nats_url, c.prefix)
        try:
            await _traffic(http, c, key, view)
            a, b = [await r.start(f"/hook-{n}") for r, n in zip(receivers, "ab", strict=True)]
            a.taking = b.taking = False
            await view.ctl.settings_set(
                ClusterSettings(
                    webhooks=(Webhook(url=a.url, format="json"), Webhook(url=b.url, format="json"))
                )
            )

            # ---- phase 1
            started = time.monotonic()
            run.say("phase 1: faults")
            c.procs["agent-n3"].signal(signal.SIGSTOP)
            c.procs["router-2"].signal(signal.SIGSTOP)
            trigger.touch()
            judge = asyncio.create_task(_break_judge(run, key, view))
            release = asyncio.Event()
            filler = asyncio.create_task(_hold_the_slot(run, key, "slow", release))
            router3 = f"127.0.0.1:{ports['router-3']}"
            ledger = asyncio.create_task(_ledger_behind(run, key, "router-3", router3, cut3))

            async def free_the_slot() -> None:
                release.set()

            async def take(r: Receiver) -> None:
                r.taking = True

            async def b200_node() -> None:
                c.start_agent("n5", "1xB200-180GB")

            async def untrigger() -> None:
                trigger.unlink()

            faults = [
                Fault(
                    "agent n3 frozen", [Expect("LlmgwNodeLost")], _signal(c.procs["agent-n3"], signal.SIGCONT)
                ),
                Fault(
                    "router-2 frozen",
                    [Expect("LlmgwServiceDown", {"job": "llmgw-router"})],
                    _signal(c.procs["router-2"], signal.SIGCONT),
                ),
                Fault("reconcile passes raise", [Expect("LlmgwControlPlaneFailingPasses")], untrigger),
                Fault("model big needs a B200", [unplaceable], b200_node),
                Fault(
                    "router-3 cut from the bus since its start",
                    [Expect("LlmgwRouterWithoutRouting")],
                    cut3.restore,
                ),
                Fault(
                    "judge's engine killed mid-stream",
                    [
                        Expect("LlmgwWatchedModelDown"),
                        Expect("LlmgwStreamsNotMigrated", {"model": "judge"}),
                        Expect("LlmgwRequestsHeldLong", {"model": "judge"}),
                    ],
                ),
                Fault(
                    "webhook A refuses",
                    [Expect("LlmgwWebhookBacklog", {"target": target_id(a.url)})],
                    lambda: take(a),
                ),
                Fault(
                    "webhook B refuses",
                    [
                        Expect("LlmgwWebhookBacklog", {"target": target_id(b.url)}),
                        Expect("LlmgwWebhookGaveUp"),
                    ],
                    lambda: take(b),
                ),
                Fault(
                    "slow's only slot held by a long stream",
                    [Expect("LlmgwProbeOverBudget", {"model": "slow"})],
                    free_the_slot,
                ),
                Fault(
                    "router-3 routing, then cut from the bus and asked",
                    [Expect("LlmgwUsageLedgerBehind", {"instance": router3})],
                    cut3.restore,
                ),
            ]
            await run.phase(faults, started, [judge, ledger, filler])
            await judge
            await ledger
            await filler
            run.say("phase 1: every alert fired and resolved")
            # slow's probes were over their budget (waiting for the slot), not refused or answered in error.
            over = await query(
                http, prom, 'max(llmgw_notifier_probes_total{model="slow",outcome="over_budget"})'
            )
            assert over and float(over[0]["value"][1]) >= 2, over

            # ---- the dashboard, against what the cluster did
            for path in dashboards():
                for title, expr in queries(path):
                    got = await query(http, prom, expr)
                    assert got, f"{path.name}: {title}: no result for {expr!r}"
            run.say("dashboard: every query answered")

            # ---- phase 2: the control plane
            started = time.monotonic()
            no_leader = Expect("LlmgwNoLeader")

            async def reconnect() -> None:
                assert cut is not None
                await cut.restore()

            await cut.cut()
            run.say("phase 2: control plane cut from the bus")
            await run.phase([Fault("control plane cut from the bus", [no_leader], reconnect)], started)
            await eventually(
                lambda: _leaders(http, prom, 1.0),
                timeout=30,
                every=0.5,
                what="the control plane to lead again",
            )
            started = time.monotonic()
            cp = c.procs["cp-a"]
            cp.signal(signal.SIGSTOP)
            run.say("phase 2: control plane frozen")
            await run.phase(
                [
                    Fault(
                        "control plane frozen",
                        [no_leader, Expect("LlmgwServiceDown", {"job": "llmgw-controlplane"})],
                        _signal(cp, signal.SIGCONT),
                    )
                ],
                started,
            )
            run.say("phase 2: every alert fired and resolved")
        finally:
            await view.close()

        shipped = {
            r["alert"]
            for f in rule_files()
            for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"]
        }
        seen = {a for _, alerts in log.polls for a in (x["alertname"] for x in alerts)}
        assert shipped <= seen, f"shipped rules no fault of this test raised: {sorted(shipped - seen)}"
        print(run.report())
    except AssertionError as e:
        extra = stack.diagnostics() if stack is not None else ""
        raise AssertionError(f"{e}\n{extra}\n{c.diagnostics()}") from None
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for task in (boot_hold, judge, ledger, filler):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError, AssertionError):
                    await task
        if stack is not None:
            await asyncio.to_thread(stack.stop)
        await c.aclose()
        for proxy in (cut, cut3):
            if proxy is not None:
                await proxy.cut()
        for receiver in receivers:
            await receiver.stop()
        await http.aclose()


def _via(trigger: Path, nats_url: str) -> list[str]:
    """The launcher (launcher.py) that puts a service on the bus through ``nats_url`` (a cut of the
    test's) and arms a control plane's fault."""
    return [sys.executable, str(LAUNCHER), str(trigger), nats_url]


def _start_cp(c: ChaosCluster, launcher: list[str], admin_port: int) -> Proc:
    """The harness's control plane (its own start has no admin port to give) with ``launcher``."""
    return c._proc(
        "cp-a",
        ["controlplane", "--catalog", str(c.catalog_path), "--admin-port", str(admin_port)],
        {},
        launcher,
    )


async def _chat(
    http: httpx.AsyncClient, base: str, key: str, model: str, timeout: float = 10.0, max_tokens: int = 4
) -> httpx.Response:
    return await http.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


async def _traffic(http: httpx.AsyncClient, c: ChaosCluster, key: str, view: BusView) -> None:
    """Answers for the dashboard's request and TTFT panels; retries for its retry panel (one of chat's two
    engines killed under requests: those sent to it go again to the other); refusals for its tenancy
    panels: a key allowed one request a minute, asked twice (429), and for a model it may not use (404)."""
    metrics = f"http://127.0.0.1:{c.procs['router'].admin_port}/metrics"
    for _ in range(3):  # the router picks by load: some of the requests go to the dead engine
        pids = await eventually(
            lambda: view.engine_pids("n1") or None,
            timeout=30,
            every=0.2,
            what="chat on n1",
            tolerate=BUS_ERRORS,
        )
        os.killpg(next(iter(pids.values())), signal.SIGKILL)
        answers = await asyncio.gather(*(_chat(http, c.router_url(), key, "chat") for _ in range(12)))
        assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
        if 'llmgw_router_retries_total{model="chat"}' in (await http.get(metrics)).text:
            break
    else:
        raise AssertionError("three killed engines under 12 requests each, and not one request retried")
    limited, _ = await create_key(view.nc, c.prefix, "limited", models=["chat"], limits=KeyLimits(rpm=1))

    async def known() -> bool:  # the routers hear of a new key from the bus (401 until then)
        return (await _chat(http, c.router_url(), limited, "chat")).status_code != 401

    await eventually(known, timeout=15, every=0.2, what="the router to know the limited key")
    # Two more: the window is the UTC minute, which may turn between the first and the second.
    statuses = [
        (await _chat(http, c.router_url(), limited, m)).status_code for m in ("chat", "chat", "judge")
    ]
    assert 429 in statuses[:2] and statuses[2] == 404, statuses


async def _break_judge(run: Run, key: str, view: BusView) -> None:
    """A stream from judge's only replica, its engine killed after the first bytes (no replica left to
    continue it), then requests held while the agent starts a new one (JUDGE_START_S)."""
    pids = await eventually(
        lambda: _ready_pids(view, "n4", "judge") or None,
        timeout=15,
        every=0.2,
        what="judge's engine",
        tolerate=BUS_ERRORS,
    )
    (pid,) = pids
    body = {
        "model": "judge",
        "messages": [{"role": "user", "content": "tell"}],
        "max_tokens": 400,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with run.http.stream(
        "POST", f"{run.cluster.router_url()}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as resp:
        assert resp.status_code == 200
        chunks = resp.aiter_bytes()
        await anext(chunks)
        os.killpg(pid, signal.SIGKILL)
        run.say(f"judge's engine {pid} killed mid-stream")
        with contextlib.suppress(httpx.HTTPError):
            async for _ in chunks:
                pass
    down = Expect("LlmgwWatchedModelDown")
    await eventually(lambda: run.log.held_now(down), timeout=30, every=0.25, what=str(down))
    held = await asyncio.gather(
        *(_chat(run.http, run.cluster.router_url(), key, "judge", 60) for _ in range(3))
    )
    assert [r.status_code for r in held] == [200] * 3, [r.text for r in held]
    run.say("requests held for judge answered")


def _ready_pids(view: BusView, node: str, model: str) -> list[int]:
    """The engine PIDs of ``model``'s ready shards on ``node`` (n4 runs judge and slow)."""
    hb = view.heartbeats.get(node)
    shards = hb.shards if hb is not None else ()
    return [s.pid for s in shards if s.model == model and s.state is ShardState.READY and s.pid is not None]


async def _hold_the_slot(run: Run, key: str, model: str, release: asyncio.Event) -> None:
    """A stream long enough to hold ``model``'s only slot until ``release`` (then closed): the engine is
    ready, and every other request (the notifier's probes) waits behind it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "tell"}],
        "max_tokens": 4000,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with run.http.stream(
        "POST", f"{run.cluster.router_url()}/v1/chat/completions", json=body, headers=headers, timeout=300
    ) as resp:
        assert resp.status_code == 200, await resp.aread()
        run.say(f"{model}'s only slot taken by a long stream")
        async for _ in resp.aiter_bytes():  # a token every 50 ms
            if release.is_set():
                return
    raise AssertionError(f"the stream holding {model}'s slot ended before the test ended it")


async def _ledger_behind(run: Run, key: str, name: str, instance: str, cut: TcpCut) -> None:
    """Once router ``name`` routes (its bus mended) and its usage ledger has written, its bus is cut
    again and it answers one request: that usage waits, unwritten, until the bus is back."""
    base = run.cluster.router_url(name)
    metrics = f"http://{instance}/metrics"

    async def answered() -> bool:
        return (await _chat(run.http, base, key, "chat")).status_code == 200

    await eventually(answered, timeout=60, every=0.5, what=f"{name} to answer", tolerate=(httpx.HTTPError,))

    async def written() -> bool:
        text = (await run.http.get(metrics)).text
        ok = value(text, "llmgw_router_usage_ledger_writes_total", outcome="ok")
        return ok is not None and ok >= 1 and value(text, LEDGER_AGE) == 0

    await eventually(written, timeout=30, every=0.25, what=f"{name}'s usage ledger to have written")
    await cut.cut()
    r = await _chat(run.http, base, key, "chat")
    assert r.status_code == 200, r.text
    run.say(f"{name} cut from the bus, and answered: its usage waits unwritten")

    async def failing() -> bool:
        return value((await run.http.get(metrics)).text, "llmgw_router_usage_ledger_failing") == 1

    await eventually(failing, timeout=15, every=0.25, what=f"{name}'s usage ledger to say it is failing")


async def _listed(http: httpx.AsyncClient, base: str, key: str, model: str) -> bool:
    r = await http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
    return r.status_code == 200 and model in {m["id"] for m in r.json()["data"]}


async def _leaders(http: httpx.AsyncClient, prom: str, n: float) -> bool:
    got = await query(http, prom, "sum(llmgw_controlplane_leader)")
    return bool(got) and float(got[0]["value"][1]) == n
