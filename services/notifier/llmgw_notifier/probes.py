"""Probes of watched models: a tiny real request through a router, every ``probe_every``.

A probe fails when the router does not answer 2xx within the model's ``budget`` (a slow answer that
arrives within the budget is a success: a cold model is not a down one). ``failures`` failures in a
row emit ``model.down`` once; the next success emits ``model.recovered`` once. A 401/403 says the
notifier's probe key is wrong, not that the model is down: it is logged and changes nothing.

As for the control plane, a model is only down once it was up: failures count only after the model
answered a probe or had a ready endpoint (the routing table's ``endpoints``) while watched. A model
whose first replica is still starting is not down, however many probes fail meanwhile.

Events go into the events stream like the control plane's, with a stable id
``model.down:<model>:probe:<episode start, ms>`` (and ``model.recovered:`` with the same episode), so
a retried publish is dropped by JetStream's duplicate window. The control plane independently emits
``model.down`` when a watched model has no ready replica; ``details.source`` tells them apart, and
delivery merges them into one outage (``outages.py``).

State survives a restart: at start the notifier rebuilds it from the probe events in the stream (the
:class:`~llmgw_notifier.outages.OutageLedger`'s replay), so a model it had declared down is not
declared down again, and its recovery is still announced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import httpx
import nats.errors
from nats.js import JetStreamContext

from llmgw_common.bus import DropLog
from llmgw_common.catalog import WatchSpec
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.durations import format_duration
from llmgw_common.event_details import ModelDownDetails, ModelRecoveredDetails, event
from llmgw_common.messages import Event, RoutingCatalog, RoutingEndpoints
from llmgw_common.runtime import cancel_and_wait
from llmgw_common.settings import NotifierSettings
from llmgw_common.subjects import ROUTING_CATALOG, ROUTING_ENDPOINTS, Subjects
from llmgw_notifier.delivery import NotifierStats
from llmgw_notifier.formats import utc
from llmgw_notifier.outages import DOWN, PROBE, RECOVERED, OutageLedger

log = logging.getLogger("llmgw.notifier.probes")

SOURCE = PROBE


# ---------------------------------------------------------------- the decision (pure)


@dataclass(frozen=True, slots=True)
class ProbeState:
    failures: int = 0  # in a row
    streak_start: float | None = None  # wall time of the first failure of the current streak
    down_since: float | None = None  # set once model.down was emitted: the episode
    last_error: str | None = None
    # The model answered a probe or had a ready endpoint: only then do failures count.
    answered: bool = False


@dataclass(frozen=True, slots=True)
class Transition:
    kind: str  # DOWN or RECOVERED
    episode: float  # the streak's first failure: the same for the down and its recovery


def observe(
    state: ProbeState, ok: bool, now: float, failures_needed: int, error: str | None = None
) -> tuple[ProbeState, Transition | None]:
    """The state after one conclusive probe, and the event it calls for, if any. Failures before the
    model ever answered (its first replica still starting) are not counted: it was never up."""
    if ok:
        if state.down_since is not None:
            return ProbeState(answered=True), Transition(RECOVERED, state.down_since)
        return ProbeState(answered=True), None
    if not state.answered:
        return replace(state, last_error=error), None
    start = state.streak_start if state.streak_start is not None else now
    failures = state.failures + 1
    nxt = replace(state, failures=failures, streak_start=start, last_error=error)
    if state.down_since is None and failures >= failures_needed:
        return replace(nxt, down_since=start), Transition(DOWN, start)
    return nxt, None


def event_id(kind: str, model: str, episode: float) -> str:
    return f"{kind}:{model}:{SOURCE}:{int(episode * 1000)}"


def probe_event(
    model: str, tr: Transition, state: ProbeState, spec: WatchSpec, now: float, router_url: str
) -> Event:
    details: ModelDownDetails | ModelRecoveredDetails
    if tr.kind == DOWN:
        details = ModelDownDetails(
            source=SOURCE,
            since=tr.episode,
            budget_s=spec.budget,
            probe_every_s=spec.probe_every,
            router=router_url,
            failures=state.failures,
            last_error=state.last_error,
        )
        summary = (
            f"model {model} is not answering: {state.failures} probe(s) in a row failed or took longer than "
            f"{spec.budget:g}s, since {utc(tr.episode)}; last: {state.last_error}"
        )
    else:
        details = ModelRecoveredDetails(
            source=SOURCE,
            since=tr.episode,
            budget_s=spec.budget,
            probe_every_s=spec.probe_every,
            router=router_url,
            down_for_s=max(0.0, now - tr.episode),
        )
        summary = (
            f"model {model} answers again (down since {utc(tr.episode)}, {format_duration(now - tr.episode)})"
        )
    return event(details, id=event_id(tr.kind, model, tr.episode), subject=model, time=now, summary=summary)


# ---------------------------------------------------------------- one probe (I/O)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    conclusive: bool
    error: str | None
    elapsed: float


async def probe_once(
    client: httpx.AsyncClient,
    router_url: str,
    key: str | None,
    model: str,
    budget: float,
    clock: Callable[[], float] = time.monotonic,
) -> ProbeResult:
    """One ``/v1/chat/completions`` request with ``max_tokens: 1``, bounded by ``budget`` overall."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "stream": False,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = router_url.rstrip("/") + "/v1/chat/completions"
    t0 = clock()
    try:
        async with asyncio.timeout(budget):
            resp = await client.post(url, json=body, headers=headers, timeout=budget)
    except (TimeoutError, httpx.TimeoutException):
        return ProbeResult(False, True, f"no answer within the {budget:g}s budget", clock() - t0)
    except httpx.HTTPError as e:
        return ProbeResult(False, True, f"router {router_url} unreachable ({type(e).__name__})", clock() - t0)
    elapsed = clock() - t0
    if resp.status_code in (401, 403):
        return ProbeResult(
            False,
            False,
            f"the router refused the probe key (HTTP {resp.status_code}); set probe_key to a key allowed for {model}",
            elapsed,
        )
    if 200 <= resp.status_code < 300:
        return ProbeResult(True, True, None, elapsed)
    return ProbeResult(False, True, f"HTTP {resp.status_code}: {resp.text[:200]}", elapsed)


# ---------------------------------------------------------------- the prober (tasks, bus)


class Prober:
    """Probes every watched model of the routing catalog; ``on_catalog`` is a KvFollower callback."""

    def __init__(
        self,
        *,
        js: JetStreamContext,
        subjects: Subjects,
        settings: NotifierSettings,
        http: httpx.AsyncClient,
        stats: NotifierStats,
        drops: DropLog,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.s = settings
        self.http = http
        self.stats = stats
        self.drops = drops
        self.wall = wall
        self.clock = clock
        self.specs: dict[str, WatchSpec] = {}
        self.states: dict[str, ProbeState] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # Loops that apply() cancelled and that have not ended yet: close() ends them too.
        self.retiring: set[asyncio.Task[None]] = set()
        # Events whose publish failed, in order, per model: retried before the next one.
        self.unsent: dict[str, list[Event]] = {}
        self._warned_key: set[str] = set()
        self.ready_now: set[str] = set()  # models with a ready (not draining) endpoint, per the routing table
        # Models scaled to zero (routing table ``cold``): a probe would wake them and keep them in use.
        self.cold_now: set[str] = set()

    def restore(self, ledger: OutageLedger) -> None:
        """Take up the models this notifier had declared down from the probe events the ledger replayed."""
        for model, open_down in ledger.downs_by(SOURCE).items():
            said = open_down.said
            self.states[model] = ProbeState(
                failures=said.failures or 0,
                streak_start=said.since,
                down_since=said.since,
                last_error=said.last_error,
                answered=True,
            )
        down = [m for m, st in self.states.items() if st.down_since is not None]
        if down:
            log.info("models declared down by probes before this start: %s", ", ".join(sorted(down)))

    async def on_endpoints(self, key: str, value: bytes | None, rev: int) -> None:
        """Follow which models have a ready endpoint: a model that had one was up, so failures count."""
        if key != ROUTING_ENDPOINTS:
            return
        if value is None:
            self.ready_now = set()
            return
        try:
            re = decode(value, RoutingEndpoints)
        except DecodeError as e:
            self.drops.drop(f"{self.subjects.bucket_routing}/{key}", str(e))
            return
        self.ready_now = {m for m, eps in re.endpoints.items() if any(not e.draining for e in eps)}
        self.cold_now = set(re.cold)

    async def on_catalog(self, key: str, value: bytes | None, rev: int) -> None:
        if key != ROUTING_CATALOG:
            return
        if value is None:
            watched: dict[str, WatchSpec] = {}
        else:
            try:
                rc = decode(value, RoutingCatalog)
            except DecodeError as e:
                self.drops.drop(f"{self.subjects.bucket_routing}/{key}", str(e))
                return  # keep probing what we know
            watched = {m.name: m.watch for m in rc.catalog.models if m.watch is not None}
        self.apply(watched)

    def apply(self, watched: dict[str, WatchSpec]) -> None:
        """Start, restart (changed spec) or stop probe loops to match ``watched``."""
        for model in [m for m in self.tasks if m not in watched]:
            self._retire(self.tasks.pop(model))
            self.specs.pop(model, None)
            self.states.pop(model, None)
            self.unsent.pop(model, None)
            log.info("model %s is no longer watched: probes stop", model)
        for model, spec in watched.items():
            if self.specs.get(model) == spec and model in self.tasks and not self.tasks[model].done():
                continue
            old = self.tasks.pop(model, None)
            if old is not None:
                self._retire(old)
            self.specs[model] = spec
            self.tasks[model] = asyncio.create_task(self._loop(model, spec), name=f"probe-{model}")
            log.info(
                "probing %s every %gs (budget %gs, down after %d failure(s))",
                model,
                spec.probe_every,
                spec.budget,
                spec.failures,
            )

    def _retire(self, task: asyncio.Task[None]) -> None:
        """Stop a loop that is no longer ``tasks[model]``. Its cancel can be swallowed by an event's
        js.publish (see cancel_and_wait), and apply() is sync, so it cannot cancel again until the loop
        ends: the loop itself stops at its next turn once retired (:meth:`_retired`), and close() ends
        one still under way."""
        if task.done():
            return
        task.cancel()
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    def _retired(self, model: str) -> bool:
        """Whether the running loop of ``model`` was replaced or dropped (its successor owns the model's
        state, or nobody does)."""
        return self.tasks.get(model) is not asyncio.current_task()

    def revive(self) -> None:
        """Restart probe loops that died (a bug in one probe): logged, and the model is probed again."""
        for model, t in self.tasks.items():
            if t.done() and not t.cancelled() and (e := t.exception()) is not None:
                log.error("probe loop of %s crashed; restarting it", model, exc_info=e)
        self.apply(dict(self.specs))

    async def close(self) -> None:
        tasks = [*self.tasks.values(), *self.retiring]
        self.tasks.clear()
        # Not one cancel: an event's js.publish can swallow it (see cancel_and_wait).
        await cancel_and_wait(tasks)

    async def _loop(self, model: str, spec: WatchSpec) -> None:
        while not self._retired(model):
            t0 = self.clock()
            if model in self.cold_now and not self._is_down(model):
                # Cold is not down: once woken it is starting again, and failures count once it answers.
                self.states.pop(model, None)
                await asyncio.sleep(spec.probe_every)
                continue
            result = await probe_once(
                self.http, self.s.router_url, self.s.probe_key, model, spec.budget, self.clock
            )
            if self._retired(model):
                return  # its successor's probes count, not this one's
            await self.record(model, spec, result)
            await asyncio.sleep(max(0.0, spec.probe_every - (self.clock() - t0)))

    def _is_down(self, model: str) -> bool:
        st = self.states.get(model)
        return st is not None and st.down_since is not None

    async def record(self, model: str, spec: WatchSpec, result: ProbeResult) -> None:
        """Fold one probe result into the model's state; publish the event it calls for."""
        if not result.conclusive:
            if model not in self._warned_key:
                self._warned_key.add(model)
                log.error("probe of %s: %s", model, result.error)
            return
        self._warned_key.discard(model)
        if not result.ok:
            log.info("probe of %s failed after %.2fs: %s", model, result.elapsed, result.error)
        now = self.wall()
        state = self.states.get(model, ProbeState())
        if not state.answered and model in self.ready_now:
            state = replace(state, answered=True)
        state, tr = observe(state, result.ok, now, spec.failures, result.error)
        self.states[model] = state
        queue = self.unsent.setdefault(model, [])
        if tr is not None:
            ev = probe_event(model, tr, state, spec, now, self.s.router_url)
            (log.warning if tr.kind == DOWN else log.info)("%s", ev.summary)
            queue.append(ev)
        while queue:
            if not await self._publish(queue[0]):
                break
            queue.pop(0)

    async def _publish(self, ev: Event) -> bool:
        try:
            await self.js.publish(
                self.subjects.event(ev.kind),
                encode(ev),
                stream=self.subjects.events_stream,
                headers={"Nats-Msg-Id": ev.id},
            )
        except (nats.errors.Error, TimeoutError) as e:
            log.warning("could not publish %s (%s); retrying after the next probe", ev.id, e)
            return False
        self.stats.events_emitted += 1
        return True
