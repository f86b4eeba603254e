"""The agent process: report this node, follow its assignment, keep its engines as assigned.

Pipeline, once per tick (``load_interval_s``): heartbeat when due; inventory when due, changed or after
a reconnect; one flush. Beside the tick, the load feed reads every ready engine's ``/metrics`` each
``load_scrape_s`` and sends a replica's load when it changed, at most each ``load_min_gap_s`` and at least
each heartbeat (load_feed.py, load_pacing.py), and a
KV follower on ``<prefix>_assign`` key ``<node>`` marks the assignment changed, and one converger task
applies :func:`llmgw_agent.converge.plan_converge` to the supervisor. Shard state changes are published
as they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import BaseModel

from llmgw_agent import tokenizer_store
from llmgw_agent.adapter_sync import AdapterSync
from llmgw_agent.converge import Running, ShardKey, Wanted, assignment_fingerprint, plan_converge
from llmgw_agent.engines import LaunchSpec, Refusal, launch_spec, vllm_model_dir
from llmgw_agent.kvrelay import Feed, KvRelay
from llmgw_agent.load_feed import LoadFeed
from llmgw_agent.load_pacing import Pacing
from llmgw_agent.metrics import extract_load, lora_busy, parse_prometheus
from llmgw_agent.settings import AgentSettings
from llmgw_agent.statefile import EngineRecord
from llmgw_agent.supervisor import Shard, Supervisor
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import (
    Assignment,
    Heartbeat,
    Inventory,
    LoadReport,
    ReplicaLoad,
    ShardAssignment,
    ShardState,
    ShardStatus,
)
from llmgw_common.subjects import Subjects, check_token
from llmgw_runtime.bus import DropLog, connect_unless_stopped, ensure_kv, ensure_object_store, flush
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.runtime import cancel_and_wait, until_stopped

log = logging.getLogger("llmgw.agent")

Collect = Callable[[AgentSettings, str, float], Inventory]
# Re-collect the inventory this often (capped by inventory_interval_s) to notice a change.
INVENTORY_CHECK_S = 10.0
CONVERGE_EVERY_S = 10.0
# A /metrics page slower than this is a blank line (running, waiting, KV use unknown), not a wait: the
# load feed reads each engine on its own, so a slow one holds only itself.
SCRAPE_TIMEOUT_S = 0.8


def _nvml_collect(s: AgentSettings) -> tuple[Collect, Callable[[], None]]:
    """The real inventory, with one NVML probe kept for the agent's life (XIDs seen accumulate)."""
    from llmgw_agent.gpus import GpuProbe
    from llmgw_agent.inventory import collect_inventory

    probe = GpuProbe(overrides=dict(s.gpu_class_overrides))

    def collect(s: AgentSettings, boot_id: str, now: float) -> Inventory:
        return collect_inventory(s, boot_id, now, probe=probe)

    return collect, probe.close


class Agent:
    """One node's agent, bound to a connected client. ``run()`` returns once ``stop`` is set."""

    def __init__(
        self,
        s: AgentSettings,
        nc: NATS,
        *,
        collect: Collect,
        boot_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.s = s
        self.nc = nc
        self.collect = collect
        self.clock = clock
        # Set by run(): the assignment watch and the agent's loops, each meant to live as long as it.
        self.follower: KvFollower | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.boot_id = boot_id or uuid.uuid4().hex
        self.subjects = Subjects(s.prefix)
        self.drops = DropLog(log)
        self.supervisor = Supervisor(
            s.state_dir,
            self._on_shard_change,
            stop_grace_s=s.stop_grace_s,
            quiesce_s=s.quiesce_s,
            clock=clock,
        )
        # None until a readable assignment (or its absence) is known: nothing is started or stopped.
        self.desired: dict[ShardKey, ShardAssignment] | None = None
        self.fence = 0
        self.adoptable: dict[ShardKey, EngineRecord] = {}
        self.seq = 0
        self._wake = asyncio.Event()
        self._scrape = httpx.AsyncClient(timeout=httpx.Timeout(SCRAPE_TIMEOUT_S, connect=0.3))
        self.load = LoadFeed(
            self._scraped,
            self._scrape_one,
            self._send_load,
            Pacing(min_gap_s=s.load_min_gap_s, max_gap_s=s.heartbeat_interval_s),
            s.load_scrape_s,
        )
        self._last_inventory: Inventory | None = None
        self._inventory_sent_at = float("-inf")
        self._inventory_checked_at = float("-inf")
        self._reconnects = 0
        # Set when the control plane asks for the inventory: sent at the next tick, as after a reconnect.
        self._inventory_asked = False
        # The replicas' KV-cache events, relayed as batched deltas (kvrelay.py).
        self.kv = KvRelay(nc, self.subjects, s.node, self.boot_id, clock=clock)
        # Tokenizers put in the object store, model -> digest (tokenizer_store.py), and the puts under way.
        self._tokenizers: dict[str, str] = {}
        self._tokenizer_tasks: set[asyncio.Task[None]] = set()
        # LoRA adapters loaded on the ready engines as their assignments ask (adapter_sync.py).
        # A load or unload done has its replica read and its line sent at once (held requests wait).
        self.adapters = AdapterSync(s, self._assigned, clock=clock, changed=self.load.read_now)

    # ---------------------------------------------------------------- publishing

    async def _publish(self, subject: str, msg: BaseModel) -> None:
        try:
            await self.nc.publish(subject, encode(msg))
        except nats.errors.Error as e:
            log.warning("cannot publish on %s: %s", subject, e)

    def kv_feeds(self) -> dict[str, Feed]:
        """The replicas whose engines publish KV events and run now (starting or ready): the relay
        follows these, and drops the entries of any other."""
        return {
            sh.assignment.replica_id: Feed(
                sh.assignment.model,
                sh.spec.kv_events,
                f"{sh.pid}:{sh.create_time}" if sh.pid is not None and sh.create_time is not None else "",
            )
            for sh in self.supervisor.shards.values()
            if sh.spec is not None
            and sh.spec.kv_events is not None
            and sh.state in (ShardState.STARTING, ShardState.READY)
        }

    def _tokenizer_bundle(self, sh: Shard) -> tokenizer_store.Bundle | None:
        """What to put for a ready replica's model: its HF tokenizer (vLLM), the simulator's, or none."""
        a = sh.assignment
        if a.shard != 0 or sh.spec is None:
            return None
        if sh.spec.simulated:
            return tokenizer_store.sim_bundle(a.model, self.clock())
        d = vllm_model_dir(a, self.s) if a.engine == "vllm" else None
        return tokenizer_store.hf_bundle(a.model, d, self.clock()) if d is not None and d.is_dir() else None

    async def _publish_tokenizer(self, sh: Shard) -> None:
        model = sh.assignment.model
        bundle = await asyncio.to_thread(self._tokenizer_bundle, sh)
        if bundle is None or self._tokenizers.get(model) == bundle.digest:
            return
        try:
            store = await ensure_object_store(
                self.nc.jetstream(), self.subjects.bucket_tokenizers, replicas=self.s.kv_replicas
            )
            put = await tokenizer_store.publish(store, bundle)
        except (nats.errors.Error, TimeoutError) as e:
            # Not this agent's end: routers fall back without it; the next ready replica tries again.
            log.warning("cannot put the tokenizer of %s in %s: %s", model, self.subjects.bucket_tokenizers, e)
            return
        self._tokenizers[model] = bundle.digest
        if put:
            log.info(
                "tokenizer of %s (%s) put in %s", model, bundle.info.kind, self.subjects.bucket_tokenizers
            )

    async def _on_shard_change(self, sh: Shard) -> None:
        self.kv.sync(self.kv_feeds())
        if sh.state is ShardState.READY:
            t = asyncio.create_task(self._publish_tokenizer(sh), name=f"tokenizer-{sh.assignment.model}")
            self._tokenizer_tasks.add(t)
            t.add_done_callback(self._tokenizer_tasks.discard)
        a = sh.assignment
        status = ShardStatus(
            node=self.s.node,
            boot_id=self.boot_id,
            sent_at=self.clock(),
            replica_id=a.replica_id,
            shard=a.shard,
            model=a.model,
            state=sh.state,
            port=a.port,
            error=sh.error,
            log_tail=sh.log_tail if sh.state is ShardState.FAILED else (),
        )
        await self._publish(self.subjects.status(self.s.node), status)

    def heartbeat(self) -> Heartbeat:
        self.seq += 1
        return Heartbeat(
            node=self.s.node,
            boot_id=self.boot_id,
            seq=self.seq,
            sent_at=self.clock(),
            address=self.s.address,
            shards=self.supervisor.reports(),
        )

    def _assigned(self, key: ShardKey) -> ShardAssignment | None:
        return self.desired.get(key) if self.desired is not None else None

    async def _scrape_one(self, sh: Shard) -> ReplicaLoad:
        a = sh.assignment
        assert sh.spec is not None and sh.spec.metrics_url is not None
        adapters, errors = self.adapters.report(sh.key)
        try:
            r = await self._scrape.get(sh.spec.metrics_url)
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.debug("scrape of %s failed: %s", sh.spec.metrics_url, e)
            return ReplicaLoad(
                replica_id=a.replica_id, shard=a.shard, adapters=adapters, adapter_errors=errors
            )
        load = extract_load(parse_prometheus(r.text), sh.spec.metrics)
        return ReplicaLoad(
            replica_id=a.replica_id,
            shard=a.shard,
            running=load.running,
            waiting=load.waiting,
            kv_use=load.kv_use,
            prefix_queries=load.prefix_queries,
            prefix_hits=load.prefix_hits,
            adapters=adapters,
            adapters_busy=(lora_busy(r.text) or ()) if sh.spec.lora_url is not None else (),
            adapter_errors=errors,
        )

    def _scraped(self) -> list[Shard]:
        """The shards whose load is read: ready, with a /metrics page."""
        return [sh for sh in self.supervisor.ready() if sh.spec is not None and sh.spec.metrics_url]

    async def load_report(self) -> LoadReport:
        """Every scraped shard's load, read now (the feed sends only the lines due)."""
        loads = await asyncio.gather(*(self._scrape_one(sh) for sh in self._scraped()))
        return LoadReport(node=self.s.node, sent_at=self.clock(), replicas=tuple(loads))

    async def _send_load(self, lines: tuple[ReplicaLoad, ...]) -> None:
        # No flush: the client's flusher writes it out at once; a flush would wait a round trip.
        report = LoadReport(node=self.s.node, sent_at=self.clock(), replicas=lines)
        await self._publish(self.subjects.load(self.s.node), report)

    async def _inventory_if_due(self, now: float) -> None:
        reconnects = int(self.nc.stats.get("reconnects", 0))
        reconnected = reconnects != self._reconnects or self._inventory_asked
        self._reconnects = reconnects
        self._inventory_asked = False
        check_every = min(INVENTORY_CHECK_S, self.s.inventory_interval_s)
        if not reconnected and now - self._inventory_checked_at < check_every:
            return
        self._inventory_checked_at = now
        inv = await asyncio.to_thread(self.collect, self.s, self.boot_id, now)
        changed = self._last_inventory is None or inv.model_copy(
            update={"sent_at": 0.0}
        ) != self._last_inventory.model_copy(update={"sent_at": 0.0})
        if changed or reconnected or now - self._inventory_sent_at >= self.s.inventory_interval_s:
            await self._publish(self.subjects.inventory(self.s.node), inv)
            self._last_inventory = inv
            self._inventory_sent_at = now

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_heartbeat = loop.time()
        while True:
            started = loop.time()
            self.kv.sync(self.kv_feeds())
            self.adapters.sync(self.supervisor.ready())
            if loop.time() >= next_heartbeat:
                await self._publish(self.subjects.heartbeat(self.s.node), self.heartbeat())
                next_heartbeat = loop.time() + self.s.heartbeat_interval_s
            await self._inventory_if_due(self.clock())
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await flush(self.nc, timeout=1)
            await asyncio.sleep(max(0.0, self.s.load_interval_s - (loop.time() - started)))

    # ---------------------------------------------------------------- assignment

    def on_assignment(self, key: str, value: bytes | None, revision: int) -> None:
        """KV callback: decode, check the fence, mark work. Never starts or stops anything itself."""
        if key != self.s.node:
            return
        if value is None:
            log.info("assignment deleted (revision %d): stopping every engine", revision)
            self.desired = {}
            self._wake.set()
            return
        try:
            assignment = decode(value, Assignment)
        except DecodeError as e:
            self.drops.drop(f"{self.subjects.bucket_assign}/{key}", f"{e}; keeping current engines")
            return
        if assignment.fence < self.fence:
            log.warning(
                "ignoring assignment revision %d with fence %d (seen %d): written by a stale leader",
                revision, assignment.fence, self.fence,
            )  # fmt: skip
            return
        self.fence = assignment.fence
        self.desired = {(sa.replica_id, sa.shard): sa for sa in assignment.shards}
        self._wake.set()
        # Adapters asked for start loading now, not at the next tick (a request may be held for one).
        self.adapters.sync(self.supervisor.ready())

    async def converge(self, *, adopt_only: bool = False) -> None:
        """Apply the converge plan; ``adopt_only``: only re-adopt engines of a previous run (the rest
        of the plan, e.g. stopping one no longer assigned, waits for the next pass)."""
        desired = self.desired
        if desired is None:
            return
        wanted = {k: Wanted(assignment_fingerprint(a), launch_spec(a, self.s)) for k, a in desired.items()}
        running = {
            k: Running(sh.fingerprint, refused=sh.error if sh.spec is None else None)
            for k, sh in self.supervisor.shards.items()
        }
        adoptable = {k: r.fingerprint for k, r in self.adoptable.items()}
        plan = plan_converge(wanted, running, adoptable)
        if adopt_only:
            adopting = {k: self.adoptable.pop(k) for k in plan.adopt}
            await asyncio.gather(*(self._adopt(r, desired[k], wanted[k].spec) for k, r in adopting.items()))
            return
        if plan.empty:
            return
        records, self.adoptable = self.adoptable, {}
        await asyncio.gather(
            *(self.supervisor.stop(k, quiesce=True) for k in plan.stop),
            *(self.supervisor.stop_orphan(records[k]) for k in plan.stop_orphans),
        )
        await asyncio.gather(*(self._adopt(records[k], desired[k], wanted[k].spec) for k in plan.adopt))
        for k in plan.refuse:
            spec = wanted[k].spec
            assert isinstance(spec, Refusal)
            await self.supervisor.refuse(desired[k], spec.reason)
        for k in plan.start:
            spec = wanted[k].spec
            assert isinstance(spec, LaunchSpec)
            await self.supervisor.start(desired[k], spec)

    async def _adopt(self, rec: EngineRecord, a: ShardAssignment, spec: LaunchSpec | Refusal) -> None:
        assert isinstance(spec, LaunchSpec)
        await self.supervisor.adopt(rec, a, spec)

    async def _converge_loop(self) -> None:
        """Converge on every change, and every ``CONVERGE_EVERY_S`` anyway (level-triggered)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CONVERGE_EVERY_S)
            self._wake.clear()
            await self.converge()

    # ---------------------------------------------------------------- lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        self.adoptable = {r.key: r for r in self.supervisor.load_state()}
        js = self.nc.jetstream()
        kv = await ensure_kv(js, self.subjects.bucket_assign, replicas=self.s.kv_replicas)
        follower = self.follower = KvFollower(kv, self.on_assignment, key=self.s.node, name="assign")
        tasks = self.tasks

        async def on_inventory_request(_: Msg) -> None:
            self._inventory_asked = True

        asked = await self.nc.subscribe(self.subjects.inventory_request(self.s.node), cb=on_inventory_request)
        try:
            await self._inventory_if_due(self.clock())
            await follower.start()
            if self.desired is None and self.s.node not in follower.revisions:
                self.desired = {}  # no assignment at all: run nothing (a stored-but-unreadable one is kept)
                self._wake.set()
            # Before the first heartbeat, so that it already says what the running engines are: the
            # control plane replaces the old boot's reports with it, and a replica it does not say is
            # ready leaves the routers' endpoints.
            await self.converge(adopt_only=True)
            await self.kv.start()
            tasks += self.kv.tasks
            tasks += [
                asyncio.create_task(self._tick_loop(), name="agent-tick"),
                asyncio.create_task(self.load.run(), name="agent-load"),
                asyncio.create_task(self._converge_loop(), name="agent-converge"),
            ]
            # A loop that ends, the assignment watch's included, is a bug whatever the way: stop cleanly
            # (engines too) and exit 70, rather than heartbeat on while deaf to new assignments.
            await until_stopped(stop, [*tasks, *follower.tasks])
        finally:
            # Not one cancel: a loop's nats request or flush can swallow it (see cancel_and_wait).
            await cancel_and_wait(tasks)
            await cancel_and_wait(list(self._tokenizer_tasks))
            await follower.stop()
            with contextlib.suppress(nats.errors.Error):
                await asked.unsubscribe()
            await self.supervisor.stop_all()
            # After the engines: every replica it followed is announced gone, in one last batch.
            await self.kv.stop()
            await self._publish(self.subjects.heartbeat(self.s.node), self.heartbeat())
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await flush(self.nc, timeout=1)
            await self.supervisor.aclose()
            await self.adapters.aclose()
            await self._scrape.aclose()


async def serve(
    s: AgentSettings,
    stop: asyncio.Event,
    *,
    collect: Collect | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Run the agent until ``stop`` is set: engines are stopped, then the NATS connection is closed."""
    close_probe: Callable[[], None] | None = None
    if collect is None:
        collect, close_probe = _nvml_collect(s)
    check_token(s.node, "node id")
    nc = await connect_unless_stopped(s, f"llmgw-agent-{s.node}", stop)
    if nc is None:
        if close_probe is not None:
            close_probe()
        return
    try:
        agent = Agent(s, nc, collect=collect, clock=clock)
        log.info("agent %s up (boot %s, state in %s)", s.node, agent.boot_id, s.state_dir)
        await agent.run(stop)
    finally:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await nc.drain()
        if not nc.is_closed:
            await nc.close()
        if close_probe is not None:
            close_probe()
