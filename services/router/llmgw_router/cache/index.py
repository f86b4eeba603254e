"""The exact KV-cache index one router holds: which replica holds which block, from the engines' events.

Fed by the agents' :class:`~llmgw_common.kvcache.KvDeltas` and :class:`~llmgw_common.kvcache.KvSnapshot`
(``follower.py`` does the I/O). Per model, a dict from block key to a bitmask of the replicas holding it
(one bit per replica *slot*, slots reused once a replica is dropped), and per replica the set of its
keys, so a replica that stops or restarts is dropped whole without a scan. Blocks of one model never
meet another's: block keys carry no model, and two models can tokenize a prompt alike.

:meth:`KvIndex.match` walks a request's keys in order and intersects the masks: a replica's longest
cached prefix ends at the first key it lacks, exactly as an engine reuses blocks (a block counts only
when every block before it is cached too), and the walk stops as soon as no replica is left.

Never wrong, possibly incomplete: every path that could leave an entry the engine no longer holds drops
instead (``cleared``, ``gone``, a snapshot replacing a replica, the cap refusing a store). An entry missing
costs one missed hit; a wrong entry would keep attracting requests to a replica that computes them cold.

Memory is bounded by ``max_entries`` (replica-block pairs). Measured with tracemalloc on CPython 3.11,
the key objects counted (the index keeps the decoded messages' ints), by
``tests/router/cache/test_cache_index.py::test_memory_per_million_blocks``:
- one replica holding 1,000,000 distinct blocks: 111.5 MB, so ~112 bytes per block (the 64-bit key
  object 36, the dict's entry and index ~45, the replica's set entry ~30);
- 4 replicas holding the same 250,000 blocks each (1,000,000 pairs): 53 MB (a shared key costs the
  dict once, each further holder one set entry).
So at most ~112 MB per million replica-block pairs; the default cap of 2 million is ~225 MB at worst
(a GPU replica of an 8B model holds ~30,000 16-token blocks: the cap is ~65 such replicas' caches).
Speed, same file (``test_match_and_apply_cost``), on the loaded 2-core build machine: ``match`` of a
125-block prompt (2,000 tokens in 16-token blocks) against 16 replicas, 2 holding all of it, 7 to 9 µs;
applying a batch of 1,000 stored keys 140 to 185 µs (~0.16 µs a key).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmgw_common.kvcache import ReplicaKv

log = logging.getLogger("llmgw.router.cache.index")

# Replica-block pairs held at most, over every model: ~112 bytes each at worst (see above).
DEFAULT_MAX_ENTRIES = 2_000_000


@dataclass(slots=True)
class _Model:
    """One model's blocks: key -> bitmask of replica slots, and each slot's replica."""

    blocks: dict[int, int] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    replica_at: dict[int, str] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    # Block size per replica; the model's is the one most of its replicas report (`block_size`).
    block_sizes: dict[str, int] = field(default_factory=dict)
    block_size: int | None = None

    def slot(self, replica: str) -> int:
        s = self.slot_of.get(replica)
        if s is None:
            # The lowest free slot, so masks stay small integers (CPython caches 0..256: no object per mask
            # while a model has at most 8 replicas).
            if self.free_slots:
                self.free_slots.sort()
                s = self.free_slots.pop(0)
            else:
                s = len(self.slot_of)
            self.slot_of[replica] = s
            self.replica_at[s] = replica
        return s

    def release(self, replica: str) -> None:
        s = self.slot_of.pop(replica, None)
        if s is not None:
            del self.replica_at[s]
            self.free_slots.append(s)
        self.block_sizes.pop(replica, None)
        self._elect_block_size()

    def set_block_size(self, replica: str, size: int) -> None:
        if self.block_sizes.get(replica) != size:
            self.block_sizes[replica] = size
            self._elect_block_size()

    def _elect_block_size(self) -> None:
        # Replicas of one model normally agree; where they do not (a CPU and a GPU replica), the router
        # keys requests by the majority's size and the others simply never match (different keys).
        counts: dict[int, int] = {}
        for b in self.block_sizes.values():
            counts[b] = counts.get(b, 0) + 1
        self.block_size = max(counts, key=lambda b: (counts[b], -b)) if counts else None


class KvIndex:
    """Per model, block key -> the replicas holding it. Pure: plain data in, plain data out."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, not {max_entries}")
        self.max_entries = max_entries
        self._models: dict[str, _Model] = {}
        # replica -> its keys: the same int objects as the dict's (no second copy), and its model.
        self._keys: dict[str, set[int]] = {}
        self._model_of: dict[str, str] = {}
        self._entries = 0
        # Stores refused at the cap (the index stays right, and misses those hits), logged once per fill.
        self.refused = 0
        self._full_logged = False

    # ------------------------------------------------------------------ reading

    @property
    def entries(self) -> int:
        """Replica-block pairs held (what ``max_entries`` bounds)."""
        return self._entries

    def blocks(self, model: str | None = None) -> int:
        """Distinct block keys held, of one model or of all."""
        if model is not None:
            m = self._models.get(model)
            return len(m.blocks) if m is not None else 0
        return sum(len(m.blocks) for m in self._models.values())

    def replicas(self, model: str | None = None) -> list[str]:
        if model is not None:
            m = self._models.get(model)
            return sorted(m.slot_of) if m is not None else []
        return sorted(self._keys)

    def replica_blocks(self, replica: str) -> int:
        keys = self._keys.get(replica)
        return len(keys) if keys is not None else 0

    def keys_of(self, replica: str) -> frozenset[int]:
        """A copy of ``replica``'s keys (for tests and inspection: a copy costs its size)."""
        return frozenset(self._keys.get(replica, ()))

    def holds(self, replica: str, key: int) -> bool:
        keys = self._keys.get(replica)
        return keys is not None and key in keys

    def block_size(self, model: str) -> int | None:
        """The block size the model's engines report (what a router keys its requests by), or None when
        no replica of it reported yet."""
        m = self._models.get(model)
        return m.block_size if m is not None else None

    def match(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """Each replica's longest cached prefix of ``keys``, in blocks; replicas with none are absent."""
        m = self._models.get(model)
        if m is None or not keys:
            return {}
        blocks = m.blocks
        alive = blocks.get(keys[0], 0)
        if not alive:
            return {}
        out: dict[str, int] = {}
        for i in range(1, len(keys)):
            nxt = alive & blocks.get(keys[i], 0)
            if nxt != alive:
                _settle(alive & ~nxt, i, m.replica_at, out)
                if not nxt:
                    return out
                alive = nxt
        _settle(alive, len(keys), m.replica_at, out)
        return out

    def match_one(self, model: str, replica: str, keys: Sequence[int]) -> int:
        """``replica``'s longest cached prefix of ``keys``, in blocks."""
        held = self._keys.get(replica)
        if held is None or self._model_of.get(replica) != model:
            return 0
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ writing

    def apply(self, kv: ReplicaKv) -> None:
        """One replica's changes from a delta batch: ``gone`` drops it, ``cleared`` empties it before
        ``stored`` applies, then ``removed`` applies last (a key in both lists is taken as removed: the
        agent sends net changes, and of the two readings "not held" is the one that cannot mislead)."""
        if kv.gone:
            self.drop(kv.replica)
            return
        if kv.cleared:
            self._clear(kv.replica)
        m = self._attach(kv.replica, kv.model, kv.block_size)
        if kv.stored:
            self._store(kv.replica, m, kv.stored)
        if kv.removed:
            self._remove(kv.replica, m, kv.removed)

    def replace(self, replica: str, model: str, block_size: int, keys: Iterable[int]) -> None:
        """A snapshot of ``replica``: its whole key set, replacing what was held of it."""
        self._clear(replica)
        m = self._attach(replica, model, block_size)
        self._store(replica, m, keys)

    def drop(self, replica: str) -> None:
        """Forget ``replica`` whole (it stopped, left the routing table, or its node lost it)."""
        model = self._model_of.get(replica)
        if model is None:
            return
        self._clear(replica)
        del self._model_of[replica]
        self._keys.pop(replica, None)
        m = self._models[model]
        m.release(replica)
        if not m.slot_of:
            del self._models[model]

    def retain(self, replicas: Iterable[str]) -> list[str]:
        """Drop every replica not in ``replicas``; returns those dropped."""
        keep = set(replicas)
        gone = [r for r in self._keys if r not in keep]
        for r in gone:
            self.drop(r)
        return gone

    # ------------------------------------------------------------------ inside

    def _attach(self, replica: str, model: str, block_size: int) -> _Model:
        was = self._model_of.get(replica)
        if was is not None and was != model:
            # A replica id names one model for its life; a message that says otherwise restarts it.
            self.drop(replica)
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model()
        m.slot(replica)
        m.set_block_size(replica, block_size)
        self._model_of[replica] = model
        if replica not in self._keys:
            self._keys[replica] = set()
        return m

    def _store(self, replica: str, m: _Model, keys: Iterable[int]) -> None:
        bit = 1 << m.slot_of[replica]
        held = self._keys[replica]
        blocks = m.blocks
        room = self.max_entries - self._entries
        before = len(held)
        for k in keys:
            if k in held:
                continue
            if room <= 0:
                self.refused += 1
                continue
            held.add(k)
            blocks[k] = blocks.get(k, 0) | bit
            room -= 1
        self._entries += len(held) - before
        if room <= 0 and not self._full_logged and self.refused:
            self._full_logged = True
            log.warning(
                "KV index full at %d entries: further stored blocks are not indexed", self.max_entries
            )

    def _remove(self, replica: str, m: _Model, keys: Iterable[int]) -> None:
        bit = 1 << m.slot_of[replica]
        held = self._keys[replica]
        blocks = m.blocks
        before = len(held)
        for k in keys:
            if k not in held:
                continue
            held.discard(k)
            rest = blocks[k] & ~bit
            if rest:
                blocks[k] = rest
            else:
                del blocks[k]
        self._entries -= before - len(held)
        self._room_again()

    def _clear(self, replica: str) -> None:
        held = self._keys.get(replica)
        model = self._model_of.get(replica)
        if not held or model is None:
            return
        m = self._models[model]
        bit = 1 << m.slot_of[replica]
        blocks = m.blocks
        for k in held:
            rest = blocks[k] & ~bit
            if rest:
                blocks[k] = rest
            else:
                del blocks[k]
        self._entries -= len(held)
        self._keys[replica] = set()
        self._room_again()

    def _room_again(self) -> None:
        if self._full_logged and self._entries < self.max_entries:
            self._full_logged = False


def _settle(mask: int, length: int, replica_at: dict[int, str], out: dict[str, int]) -> None:
    """Record ``length`` for every slot in ``mask`` (whose prefix ended here)."""
    while mask:
        low = mask & -mask
        out[replica_at[low.bit_length() - 1]] = length
        mask ^= low
