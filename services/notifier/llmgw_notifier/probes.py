"""Probes of watched models: one loop per model of the routing catalog with a ``watch``.

Every ``probe_every``, a loop sends one probe through a router (``probe_request.py``), folds its
result into the model's state (``probe_state.py``) and publishes the event a transition calls for into
the events stream; an event whose publish failed is retried before the next one. A probe refused for
its key is logged at ERROR once per model and changes nothing. A model with a ready (not draining)
endpoint in the routing table was up, so its failures count; one scaled to zero (``cold``) and not
down is not probed, since a probe would wake it.

A watched LoRA adapter (issue 33; ``AdapterProfile.watch``) is probed as a model is, by its own name
(the router loads it on a replica of its base if none holds it): a load that fails, or a base gone, fails
its probes. What counts for it is its base's: the adapter was up once the base had a ready endpoint (its
load is a request away), and it is not probed while the base is cold (a probe would wake the base).

State survives a restart: at start the notifier rebuilds it from the probe events in the stream (the
:class:`~llmgw_notifier.outages.OutageLedger`'s replay), so a model it had declared down is not
declared down again, and its recovery is still announced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import httpx
import nats.errors
from nats.js import JetStreamContext

from llmgw_common.catalog import WatchSpec
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import Event, RoutingCatalog
from llmgw_common.routing_table import RowFold
from llmgw_common.subjects import ROUTING_CATALOG, Subjects
from llmgw_notifier.outages import DOWN, OutageLedger
from llmgw_notifier.probe_request import ProbeResult, probe_once
from llmgw_notifier.probe_state import SOURCE, ProbeState, observe, probe_event
from llmgw_notifier.settings import NotifierSettings
from llmgw_notifier.stats import NotifierStats
from llmgw_runtime.bus import DropLog
from llmgw_runtime.runtime import cancel_and_wait

log = logging.getLogger("llmgw.notifier.probes")


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
        self.table = RowFold()
        # Models scaled to zero (routing table ``cold``): a probe would wake them and keep them in use.
        self.cold_now: set[str] = set()
        # Watched adapters -> their base: whose endpoints say whether the adapter was up, or is cold.
        self.base_of: dict[str, str] = {}

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
        """Follow which models have a ready endpoint: a model that had one was up, so failures count.
        Fed every key of the routing bucket: the table's rows, its head, or the legacy whole value
        (``llmgw_common.routing_table``); other keys change nothing."""
        try:
            if not self.table.on_kv(key, value):
                return
        except DecodeError as e:
            self.drops.drop(f"{self.subjects.bucket_routing}/{key}", str(e))
            return
        self.ready_now = self.table.ready_models()
        self.cold_now = self.table.cold_models()

    async def on_catalog(self, key: str, value: bytes | None, rev: int) -> None:
        if key != ROUTING_CATALOG:
            return
        bases: dict[str, str] = {}
        if value is None:
            watched: dict[str, WatchSpec] = {}
        else:
            try:
                rc = decode(value, RoutingCatalog)
            except DecodeError as e:
                self.drops.drop(f"{self.subjects.bucket_routing}/{key}", str(e))
                return  # keep probing what we know
            watched = {m.name: m.watch for m in rc.catalog.models if m.watch is not None}
            for a in rc.catalog.adapters:
                if a.watch is not None:
                    watched[a.name] = a.watch
                    bases[a.name] = a.base
        self.apply(watched, bases)

    def apply(self, watched: dict[str, WatchSpec], bases: dict[str, str] | None = None) -> None:
        """Start, restart (changed spec) or stop probe loops to match ``watched``; ``bases``: the
        watched adapters' base models."""
        self.base_of = dict(bases or {})
        for model in [m for m in self.tasks if m not in watched]:
            self._retire(self.tasks.pop(model))
            self.specs.pop(model, None)
            self.states.pop(model, None)
            self.unsent.pop(model, None)
            self.stats.forget_probes(model)
            log.info("model %s is no longer watched: probes stop", model)
        for model, spec in watched.items():
            if self.specs.get(model) == spec and model in self.tasks:
                continue  # a loop that died stays dead: housekeeping ends the notifier for it
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

    def loops(self) -> list[asyncio.Task[None]]:
        """The current probe loops, one per watched model (retired ones are not among them): one that
        ended is a death, which ends the notifier (``runtime.raise_if_died``), never revived here."""
        return list(self.tasks.values())

    async def close(self) -> None:
        tasks = [*self.tasks.values(), *self.retiring]
        self.tasks.clear()
        # Not one cancel: an event's js.publish can swallow it (see cancel_and_wait).
        await cancel_and_wait(tasks)

    async def _loop(self, model: str, spec: WatchSpec) -> None:
        while not self._retired(model):
            t0 = self.clock()
            if self.base_of.get(model, model) in self.cold_now and not self._is_down(model):
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
            self.stats.probed(model, "refused", None)
            if model not in self._warned_key:
                self._warned_key.add(model)
                log.error("probe of %s: %s", model, result.error)
            return
        self._warned_key.discard(model)
        outcome = "ok" if result.ok else "over_budget" if result.over_budget else "failed"
        self.stats.probed(model, outcome, result.elapsed)
        if not result.ok:
            log.info("probe of %s failed after %.2fs: %s", model, result.elapsed, result.error)
        now = self.wall()
        state = self.states.get(model, ProbeState())
        if not state.answered and self.base_of.get(model, model) in self.ready_now:
            state = replace(state, answered=True)
        state, tr = observe(state, result.ok, now, spec.failures, result.error)
        self.states[model] = state
        queue = self.unsent.setdefault(model, [])
        if tr is not None:
            ev = probe_event(model, tr, state, spec, now, self.s.router_url, self.base_of.get(model))
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
