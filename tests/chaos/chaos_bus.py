"""What the chaos tests read from the bus: heartbeats (engine PIDs), routing endpoints, records, ctl."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import decode
from llmgw_common.ctl import DebugStatsReply, LeaseRecord
from llmgw_common.messages import ApiKeyRecord, Event, Heartbeat, ReplicaRecord, RoutingEndpoints, ShardState
from llmgw_common.routing_table import ModelRouting, row_key
from llmgw_common.subjects import LEADER_KEY, Subjects
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlError
from llmgw_runtime.kv_follower import KvFollower
from llmgw_runtime.routing_rows import read_routing
from llmgw_runtime.settings import BusSettings
from tests.kit.poll import eventually

T = TypeVar("T")
log = logging.getLogger("chaos")


class BusView:
    """A test's own NATS client (reconnecting forever, so it survives a server restart)."""

    def __init__(self, nc: NATS, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.ctl = CtlClient(nc, prefix, timeout=1.0)
        self.heartbeats: dict[str, Heartbeat] = {}
        # Own clock (monotonic) of each node's last heartbeat.
        self.heard_at: dict[str, float] = {}

    @classmethod
    async def connect(cls, url: str, prefix: str) -> BusView:
        nc = await bus.connect(BusSettings(nats_urls=[url], prefix=prefix), "chaos-test")
        view = cls(nc, prefix)
        await bus.subscribe(
            nc, view.subjects.all_nodes("heartbeat"), Heartbeat, view._on_heartbeat, bus.DropLog(log)
        )
        await bus.flush(nc)
        return view

    async def close(self) -> None:
        await self.nc.close()

    def _on_heartbeat(self, hb: Heartbeat, _: Msg) -> None:
        self.heartbeats[hb.node] = hb
        self.heard_at[hb.node] = time.monotonic()

    # ------------------------------------------------------------ engines

    def engine_pids(self, node: str | None = None) -> dict[tuple[str, int], int]:
        """(replica id, shard) -> engine PID of every READY shard in the latest heartbeats."""
        out = {}
        for n, hb in self.heartbeats.items():
            if node is not None and n != node:
                continue
            for s in hb.shards:
                if s.state is ShardState.READY and s.pid is not None:
                    out[(s.replica_id, s.shard)] = s.pid
        return out

    def nodes_hosting(self, model: str) -> set[str]:
        return {
            n
            for n, hb in self.heartbeats.items()
            for s in hb.shards
            if s.model == model and s.pid is not None
        }

    # ------------------------------------------------------------ buckets

    async def endpoints(self) -> RoutingEndpoints | None:
        kv = await self.nc.jetstream().key_value(self.subjects.bucket_routing)
        value = await read_routing(kv)
        return value

    async def endpoint_nodes(self, model: str) -> list[str]:
        """The node of every endpoint the routers are told of for ``model`` (a replica twice: listed twice)."""
        eps = await self.endpoints()
        return [] if eps is None else [e.node for e in eps.endpoints.get(model, ())]

    async def records(self) -> dict[str, ReplicaRecord]:
        kv = await self.nc.jetstream().key_value(self.subjects.bucket_replicas)
        out = {}
        for k in await bus.kv_keys(kv):
            rec, _ = await bus.kv_get(kv, k, ReplicaRecord)
            if rec is not None:
                out[k] = rec
        return out

    async def keys(self) -> dict[str, ApiKeyRecord]:
        kv = await self.nc.jetstream().key_value(self.subjects.bucket_keys)
        out = {}
        for k in await bus.kv_keys(kv):
            rec, _ = await bus.kv_get(kv, k, ApiKeyRecord)
            if rec is not None:
                out[k] = rec
        return out

    async def desired_raw(self) -> dict[str, bytes]:
        kv = await self.nc.jetstream().key_value(self.subjects.bucket_desired)
        out = {}
        for k in await bus.kv_keys(kv):
            e = await kv.get(k)
            if e.value is not None:
                out[k] = e.value
        return out

    async def lease(self) -> tuple[LeaseRecord | None, int]:
        kv = await self.nc.jetstream().key_value(self.subjects.bucket_leader)
        return await bus.kv_get(kv, LEADER_KEY, LeaseRecord)

    async def model_events(self, model: str) -> list[Event]:
        """The ``model.*`` events about ``model`` in the events stream, in order (none before it exists)."""
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(self.subjects.events_stream)
        except nats.js.errors.NotFoundError:
            return []
        out: list[Event] = []
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            try:
                raw = await js.get_msg(self.subjects.events_stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            assert raw.data is not None
            ev = decode(raw.data, Event)
            if ev.subject == model and ev.kind.startswith("model."):
                out.append(ev)
        return out

    async def stats(self) -> DebugStatsReply | None:
        """The active control plane's stats, or None when none answers."""
        try:
            return await self.ctl.debug_stats()
        except CtlError:
            return None


class EndpointRevisions:
    """The replicas listed for one model in every revision of its routing row (a poll can miss a gap)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.seen: list[tuple[str, ...]] = []
        self._follower: KvFollower | None = None

    @classmethod
    async def follow(cls, view: BusView, model: str) -> EndpointRevisions:
        out = cls(model)
        kv = await view.nc.jetstream().key_value(view.subjects.bucket_routing)
        # The model's own row of the table (llmgw_common.routing_table): its every revision.
        out._follower = KvFollower(kv, out._on_change, key=row_key(model), name="test-endpoints")
        await out._follower.start()
        return out

    def _on_change(self, _key: str, value: bytes | None, _rev: int) -> None:
        row = None if value is None else decode(value, ModelRouting)
        self.seen.append(() if row is None else tuple(e.replica_id for e in row.endpoints))

    async def stop(self) -> None:
        if self._follower is not None:
            await self._follower.stop()


# What a bus read may meet while a server, control plane or agent is being killed or restarted: "not yet".
BUS_ERRORS: tuple[type[BaseException], ...] = (CtlError, TimeoutError, OSError, nats.errors.Error)


async def timed(
    what: str, probe: Callable[[], Awaitable[T | None]], timeout: float, every: float = 0.2
) -> tuple[T, float]:
    """``eventually(probe)`` through bus faults, and the seconds it took (what chaos tests measure)."""
    t0 = time.monotonic()
    got = await eventually(probe, timeout=timeout, every=every, what=what, tolerate=BUS_ERRORS)
    assert got is not None  # eventually returns only a truthy value
    return got, time.monotonic() - t0
