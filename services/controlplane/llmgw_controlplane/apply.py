"""The one place the control plane writes what it decided: assignments and replica records (the
routing table: routing_publisher.py).

:func:`desired_assignments` is pure: replica records + catalog + node addresses -> what each node must
run. The writers compare with what they last wrote and write only the difference, so a steady cluster
costs no KV writes, and the control plane's own writes never look like news to it.

Assignment writes are compare-and-set on the key's revision and carry the lease revision as ``fence``:
a deposed leader's write to a key its successor has written fails instead of landing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from llmgw_common.catalog import Catalog
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.messages import (
    AdapterLoad,
    Assignment,
    ReplicaRecord,
    ReplicaSpec,
    ShardAssignment,
)
from llmgw_runtime.bus import DropLog, forget_key, kv_get, kv_keys

log = logging.getLogger("llmgw.controlplane.apply")

NodeShards = tuple[ShardAssignment, ...]


class Fenced(Exception):
    """A write was refused because another control plane wrote since (this one is no longer leader)."""


def shard_assignments(
    rec: ReplicaRecord,
    catalog: Catalog,
    addresses: Mapping[str, str],
    adapters: tuple[AdapterLoad, ...] = (),
) -> list[ShardAssignment]:
    """The assignment lines of one replica; none when its model left the catalog (it is being torn down).

    Built from the spec the replica was started with: a profile change rolls replicas one at a time
    (the reconciler replaces them), it never rewrites a running replica's assignment. ``adapters`` (the
    LoRA adapters it must have loaded, issue 33) go on shard 0, the one that serves: the agent loads
    and unloads them without restarting anything.
    """
    profile = catalog.get(rec.model)
    if profile is None:
        return []
    spec = rec.spec or ReplicaSpec.of(profile)
    shards = sorted(rec.shards, key=lambda s: s.shard)
    leader = None
    if len(shards) > 1:
        s0 = shards[0]
        leader = f"{addresses.get(s0.node, '127.0.0.1')}:{s0.port}"
    return [
        ShardAssignment(
            replica_id=rec.id,
            shard=s.shard,
            shards=len(shards),
            model=rec.model,
            engine=spec.engine,
            weights=spec.weights,
            gpus=s.gpus,
            port=s.port,
            leader=leader,
            args=spec.args,
            env=dict(spec.env),
            startup_timeout_s=spec.startup_timeout_s,
            options=dict(spec.options),
            cache_routing=spec.cache_routing,
            max_loras=spec.max_loras,
            max_lora_rank=None if spec.max_loras is None else spec.max_lora_rank,
            max_cpu_loras=spec.max_cpu_loras,
            adapters=adapters if s.shard == 0 else (),
        )
        for s in shards
    ]


def desired_assignments(
    records: Mapping[str, ReplicaRecord],
    catalog: Catalog,
    addresses: Mapping[str, str],
    adapters: Mapping[str, tuple[AdapterLoad, ...]] | None = None,
) -> dict[str, NodeShards]:
    """node -> the shards it must run, in a stable order (so equal content compares equal);
    ``adapters``: replica id -> the adapters it must have loaded."""
    out: dict[str, list[ShardAssignment]] = {}
    for rid in sorted(records):
        rec = records[rid]
        by_shard = {s.shard: s for s in rec.shards}
        for a in shard_assignments(rec, catalog, addresses, (adapters or {}).get(rid, ())):
            out.setdefault(by_shard[a.shard].node, []).append(a)
    return {n: tuple(v) for n, v in out.items()}


def pin_specs(records: Mapping[str, ReplicaRecord], catalog: Catalog) -> dict[str, ReplicaRecord]:
    """Records without a spec (older control planes, or adopted from assignments) get their model's
    current one: what their assignments were built from, so pinning them restarts nothing."""
    out = dict(records)
    for rid, rec in records.items():
        profile = catalog.get(rec.model)
        if rec.spec is None and profile is not None:
            out[rid] = rec.model_copy(update={"spec": ReplicaSpec.of(profile)})
    return out


class AssignmentWriter:
    """Writes ``<prefix>_assign`` keys whose content changed, compare-and-set, with the fence."""

    def __init__(self, kv: KeyValue, drops: DropLog) -> None:
        self.kv = kv
        self.drops = drops
        # node -> (shards last written or read, key revision)
        self.written: dict[str, tuple[NodeShards, int]] = {}
        self.writes = 0

    def adapters(self) -> dict[str, tuple[str, ...]]:
        """Replica id -> the adapters its last written shard 0 asks for (a new tenure starts there)."""
        return {
            a.replica_id: tuple(x.name for x in a.adapters)
            for shards, _ in self.written.values()
            for a in shards
            if a.shard == 0 and a.adapters
        }

    async def load(self) -> dict[str, Assignment]:
        """Read every current assignment (after a start or a takeover): the base of the next diff."""
        self.written = {}
        out: dict[str, Assignment] = {}
        for node in await kv_keys(self.kv):
            try:
                e = await self.kv.get(node)
            except KeyNotFoundError:
                continue
            rev = e.revision or 0
            try:
                a = decode(e.value or b"", Assignment)
            except DecodeError as err:
                self.drops.drop(f"{self.kv._name}/{node}", str(err))
                self.written[node] = ((), rev)
                continue
            self.written[node] = (a.shards, rev)
            out[node] = a
        return out

    def pending(self, desired: Mapping[str, NodeShards]) -> dict[str, NodeShards]:
        """Nodes whose desired shards differ from what was last written (a node left with none: ())."""
        out = {n: s for n, s in desired.items() if self.written.get(n, ((), 0))[0] != s}
        for n, (shards, _) in self.written.items():
            if shards and n not in desired:
                out[n] = ()
        return out

    async def write(self, node: str, shards: NodeShards, fence: int, now: float) -> None:
        data = encode(Assignment(node=node, fence=fence, written_at=now, shards=shards))
        prev = self.written.get(node)
        try:
            if prev is None:
                rev = await self.kv.create(node, data)
            else:
                rev = await self.kv.update(node, data, last=prev[1])
        except KeyWrongLastSequenceError:
            raise Fenced(f"assignment of {node} was written by someone else") from None
        self.written[node] = (shards, rev)
        self.writes += 1


class ReplicaStore:
    """Replica records in ``<prefix>_replicas``: identities that outlive a control-plane restart."""

    def __init__(self, kv: KeyValue, drops: DropLog) -> None:
        self.kv = kv
        self.drops = drops
        self.written: dict[str, ReplicaRecord] = {}

    async def load(self) -> dict[str, ReplicaRecord]:
        out: dict[str, ReplicaRecord] = {}
        for key in await kv_keys(self.kv):
            rec, _ = await kv_get(self.kv, key, ReplicaRecord, self.drops)
            if rec is not None:
                out[rec.id] = rec
        self.written = dict(out)
        return out

    async def sync(self, records: Mapping[str, ReplicaRecord]) -> int:
        """Make the bucket hold exactly ``records``; returns the number of writes."""
        n = 0
        for rid, rec in records.items():
            if self.written.get(rid) != rec:
                await self.kv.put(rid, encode(rec))
                self.written[rid] = rec
                n += 1
        for rid in [r for r in self.written if r not in records]:
            try:
                # Forgotten, not deleted: only a takeover reads this bucket, by listing its keys, and a
                # delete marker per replica ever stopped (every autoscaling step makes one) is listed too.
                await forget_key(self.kv, rid)
            except nats.errors.Error as e:
                log.warning("could not delete replica record %s: %s", rid, e)
                continue
            del self.written[rid]
            n += 1
        return n
