"""The exact KV-cache index one router holds: which replica holds which block, from the engines' events.

Fed by the agents' :class:`~llmgw_common.kvcache.KvDeltas` and :class:`~llmgw_common.kvcache.KvSnapshot`
(``follower.py`` does the I/O). Per model, one dict from block key to a bitmask of the replicas holding
it (one bit per replica *slot*), nothing else per block: a replica's keys are the keys with its bit. A
replica dropped or cleared gives its slot up at once, so no match sees it, and :meth:`KvIndex.sweep`
clears its bits later, a budget at a time (dropping a million blocks never stalls the event loop); a
slot is reused once swept. Blocks of one model never meet another's: block keys carry no model, and
two models can tokenize a prompt alike.

:meth:`KvIndex.match` walks a request's keys in order and intersects the masks: a replica's longest
cached prefix ends at the first key it lacks, exactly as an engine reuses blocks (a block counts only
when every block before it is cached too), and the walk stops as soon as no replica is left.

Never wrong, possibly incomplete: every path that could leave an entry the engine no longer holds drops
instead (``cleared``, ``gone``, a snapshot replacing a replica, the cap refusing a store). An entry missing
costs one missed hit; a wrong entry would keep attracting requests to a replica that computes them cold.

Memory is bounded by ``max_entries`` (replica-block pairs, those awaiting the sweep included). Measured
with tracemalloc on CPython 3.11, the key objects counted (the index keeps the decoded messages' ints),
by ``tests/router/cache/test_cache_index.py::test_memory_per_million_blocks``:
- one replica holding 1,000,000 distinct blocks: 78 MB, so ~78 bytes per block (the 64-bit key object
  36, the dict's entry and index ~42; a mask under 257 is a shared small int);
- 4 replicas holding the same 250,000 blocks each (1,000,000 pairs): 19.5 MB (a shared block costs once).
So at most ~78 MB per million replica-block pairs; the default cap of 2 million is ~160 MB at worst
(a GPU replica of an 8B model holds ~30,000 16-token blocks: the cap is ~65 such replicas' caches).

Speed, on the loaded 2-core build machine (same file, ``test_match_and_apply_cost``): ``match`` of a
125-block prompt (2,000 tokens in 16-token blocks) against 16 replicas, 2 holding all of it, 7 to 12 µs; a
batch of 1,000 stored keys 0.14 to 0.25 ms. In steady state (``bench/kv_index_apply.py``: 32 replicas at
10,000 blocks, each batch storing 375 new keys per node and evicting as many), applying a key stored or
removed costs ~0.1 µs of CPU and decoding its message (msgpack, then pydantic) ~0.07 µs, where the
writers of a key at a time cost 0.25-0.27 µs (measured side by side, 2.3-2.5x). Most of what is left is
memory access: a probe of a large dict per key stored, a pop per key removed, and the int objects msgpack
makes. At 1,000 requests/s of 2,000 fresh tokens each (125 blocks stored and as many evicted per request,
no prefix reused: the worst case) that is 250,000 changes/s; ``bench/kv_firehose.py`` measures the
router's whole cost of following them (see bench/RESULTS.md); a conversation's next turn stores only its
new blocks (~15-20 for a turn and its answer).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice, repeat
from operator import not_

from llmgw_common.kvcache import ReplicaKv

log = logging.getLogger("llmgw.router.cache.index")

# Replica-block pairs held at most, over every model: ~78 bytes each at worst (see above).
DEFAULT_MAX_ENTRIES = 2_000_000


@dataclass(slots=True)
class _Model:
    """One model's blocks: key -> bitmask of replica slots, and each slot's replica.

    A replica dropped or cleared gives up its slot at once (``live`` loses the bit, so no match sees it)
    but its bits stay in the masks until :meth:`KvIndex.sweep` clears them a budget at a time: dropping
    a replica of a million blocks never stalls the event loop. A slot is reused only once swept."""

    blocks: dict[int, int] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    replica_at: dict[int, str] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    next_slot: int = 0
    live: int = 0
    # Slots given up and not yet swept, and the keys of a sweep under way (the dict's keys when it began:
    # a key stored since carries live bits only) with where it is and which slots it clears.
    dead: int = 0
    sweep_keys: list[int] | None = None
    sweep_pos: int = 0
    sweep_mask: int = 0
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
                s = self.next_slot
                self.next_slot += 1
            self.slot_of[replica] = s
            self.replica_at[s] = replica
            self.live |= 1 << s
        return s

    def give_up(self, replica: str, held: bool) -> None:
        """``replica`` leaves its slot: free at once when it held nothing, else once swept."""
        s = self.slot_of.pop(replica, None)
        if s is None:
            return
        del self.replica_at[s]
        self.live &= ~(1 << s)
        if held:
            self.dead |= 1 << s
        else:
            self.free_slots.append(s)

    def release(self, replica: str) -> None:
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
        # replica -> its model, and how many keys it holds (its keys are the dict's keys with its bit set).
        self._model_of: dict[str, str] = {}
        self._count: dict[str, int] = {}
        self._entries = 0
        # Entries of given-up slots still in the masks (memory not yet freed by ``sweep``).
        self._dead_entries = 0
        # Stores refused at the cap (the index stays right, and misses those hits), logged once per fill.
        self.refused = 0
        self._full_logged = False

    # ------------------------------------------------------------------ reading

    @property
    def entries(self) -> int:
        """Replica-block pairs held (with ``dead_entries``, what ``max_entries`` bounds)."""
        return self._entries

    @property
    def dead_entries(self) -> int:
        """Pairs of dropped or cleared replicas not swept yet: no match sees them, they still take memory."""
        return self._dead_entries

    @property
    def sweeping(self) -> bool:
        return self._dead_entries > 0 or any(m.dead for m in self._models.values())

    def blocks(self, model: str | None = None) -> int:
        """Distinct block keys held, of one model or of all (with those of dropped replicas until swept)."""
        if model is not None:
            m = self._models.get(model)
            return len(m.blocks) if m is not None else 0
        return sum(len(m.blocks) for m in self._models.values())

    def replicas(self, model: str | None = None) -> list[str]:
        if model is not None:
            m = self._models.get(model)
            return sorted(m.slot_of) if m is not None else []
        return sorted(self._model_of)

    def replica_blocks(self, replica: str) -> int:
        return self._count.get(replica, 0)

    def keys_of(self, replica: str) -> frozenset[int]:
        """``replica``'s keys (for tests and inspection: a scan of its model's blocks)."""
        found = self._where(replica)
        return frozenset(_marked(found[0].blocks, found[1])) if found else frozenset()

    def holds(self, replica: str, key: int) -> bool:
        found = self._where(replica)
        return found is not None and bool(found[0].blocks.get(key, 0) & found[1])

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
        alive = blocks.get(keys[0], 0) & m.live
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
        found = self._where(replica)
        if found is None or self._model_of.get(replica) != model:
            return 0
        blocks, bit = found[0].blocks, found[1]
        n = 0
        for k in keys:
            if not blocks.get(k, 0) & bit:
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
        m = self._models[model]
        m.give_up(replica, held=False)  # no-op if _clear gave its slot up already
        m.release(replica)
        del self._model_of[replica]
        self._count.pop(replica, None)
        if not m.slot_of and not m.dead:
            del self._models[model]

    def retain(self, replicas: Iterable[str]) -> list[str]:
        """Drop every replica not in ``replicas``; returns those dropped."""
        keep = set(replicas)
        gone = [r for r in self._model_of if r not in keep]
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
        self._count.setdefault(replica, 0)
        return m

    # The writers loop in C (map, dict.update, list.count) rather than per key in Python, build no object
    # per key, and touch each key's dict entry once in the common cases: one setdefault to store a key,
    # one pop to remove a key only this replica held. Following the events is the router's steady background cost, bound by memory access
    # on a large index. Counts come from the dict's size and the masks seen, so a key listed twice in
    # one batch counts once.

    def _store(self, replica: str, m: _Model, keys: Iterable[int]) -> None:
        bit = 1 << m.slot_of[replica]
        blocks = m.blocks
        ks = keys if isinstance(keys, list) else list(keys)
        room = self.max_entries - self._entries - self._dead_entries
        if len(ks) > room:
            self._store_at_cap(replica, m, bit, ks, room)
            return
        # One setdefault a key, in C: a key no replica holds gets this replica's bit, and each returns the
        # mask the key has now, which is the bit itself unless other replicas held the key before.
        before = len(blocks)
        got = list(map(blocks.setdefault, ks, repeat(bit)))
        added = len(blocks) - before
        if got.count(bit) != len(got):
            # Keys other replicas held: this replica's bit added (each once, where it lacked it).
            lacking = {k: mask for k, mask in zip(ks, got, strict=True) if not mask & bit}
            blocks.update(zip(lacking, map(bit.__or__, lacking.values()), strict=True))
            added += len(lacking)
        self._count[replica] += added
        self._entries += added

    def _store_at_cap(self, replica: str, m: _Model, bit: int, ks: list[int], room: int) -> None:
        """A batch that may not all fit: the new pairs in the batch's order, kept while there is room."""
        blocks = m.blocks
        new = {k: blocks.get(k, 0) | bit for k in ks if not blocks.get(k, 0) & bit}
        if len(new) > room:
            # The first ones in the batch's order are kept: a chain's early blocks are the ones that match.
            keep = max(room, 0)
            self.refused += len(new) - keep
            new = dict(islice(new.items(), keep))
            if not self._full_logged:
                self._full_logged = True
                log.warning(
                    "KV index full at %d entries: further stored blocks are not indexed", self.max_entries
                )
        blocks.update(new)
        self._count[replica] += len(new)
        self._entries += len(new)

    def _remove(self, replica: str, m: _Model, keys: Iterable[int]) -> None:
        bit = 1 << m.slot_of[replica]
        blocks = m.blocks
        ks = keys if isinstance(keys, list) else list(keys)
        # Popped first: most removed keys were held by this replica alone (their mask exactly ``bit``), and
        # one pop both reads and deletes them. A key listed twice pops 0 the second time.
        popped = list(map(blocks.pop, ks, repeat(0)))
        n = popped.count(bit)
        if n + popped.count(0) != len(popped):
            # Keys other replicas hold too go back without this replica's bit (or whole, where it had none).
            back = {k: mask for k, mask in zip(ks, popped, strict=True) if mask and mask != bit}
            n += sum(1 for mask in back.values() if mask & bit)
            blocks.update(zip(back, map(int.__and__, back.values(), repeat(~bit)), strict=True))
        if n:
            self._count[replica] -= n
            self._entries -= n
            self._room_again()

    def _clear(self, replica: str) -> None:
        """Every key of ``replica`` forgotten: its slot given up at once (no match sees it), its bits left
        for ``sweep``; the replica, if it goes on, takes a fresh slot."""
        found = self._where(replica)
        n = self._count.get(replica, 0)
        if found is None or not n:
            return
        found[0].give_up(replica, held=True)
        self._count[replica] = 0
        self._entries -= n
        self._dead_entries += n

    def sweep(self, budget: int = 20_000) -> bool:
        """Clear given-up slots' bits from up to ``budget`` keys (a few ms); True while work remains. The
        follower calls it between messages until it returns False."""
        for name, m in list(self._models.items()):
            if m.sweep_keys is None:
                if not m.dead:
                    continue
                m.sweep_keys, m.sweep_pos, m.sweep_mask = list(m.blocks), 0, m.dead
            dead = m.sweep_mask
            ks = m.sweep_keys[m.sweep_pos : m.sweep_pos + budget]
            m.sweep_pos += len(ks)
            blocks = m.blocks
            masks = list(map(blocks.get, ks, repeat(0)))
            hit = list(map(dead.__and__, masks))
            keys = list(compress(ks, hit))
            rest = list(map(int.__and__, compress(masks, hit), repeat(~dead)))
            self._dead_entries -= sum(map(int.bit_count, compress(hit, hit)))
            for k in compress(keys, map(not_, rest)):
                del blocks[k]
            blocks.update(zip(compress(keys, rest), filter(None, rest), strict=False))
            self._room_again()
            if m.sweep_pos >= len(m.sweep_keys):
                m.sweep_keys, m.dead = None, m.dead & ~dead
                m.free_slots.extend(i for i in range(dead.bit_length()) if dead >> i & 1)
                if not m.slot_of and not m.dead:
                    del self._models[name]
            return True
        return False

    def _where(self, replica: str) -> tuple[_Model, int] | None:
        model = self._model_of.get(replica)
        if model is None:
            return None
        m = self._models[model]
        s = m.slot_of.get(replica)
        return None if s is None else (m, 1 << s)

    def _room_again(self) -> None:
        if self._full_logged and self._entries + self._dead_entries < self.max_entries:
            self._full_logged = False


def _marked(blocks: dict[int, int], bit: int) -> list[int]:
    """The keys of ``blocks`` whose mask has ``bit`` (keys and values of an unchanged dict pair up)."""
    return list(compress(blocks.keys(), map(bit.__and__, blocks.values())))


def _settle(mask: int, length: int, replica_at: dict[int, str], out: dict[str, int]) -> None:
    """Record ``length`` for every slot in ``mask`` (whose prefix ended here)."""
    while mask:
        low = mask & -mask
        out[replica_at[low.bit_length() - 1]] = length
        mask ^= low
