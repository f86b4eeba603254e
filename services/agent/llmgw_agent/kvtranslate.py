"""One replica's KV-cache events, turned into llmgw block keys: pure, on plain data.

An engine names its blocks by its own hashes; routers name a request's blocks by
:func:`llmgw_common.kvcache.chain_key` over token ids. :class:`ReplicaBlocks` keeps, per replica, the
engine hash -> llmgw key of every block the engine holds and the set of keys it holds, and turns each
decoded batch (``llmgw_common.vllm_kv_events``) into the keys that appeared and disappeared.

What it will not do is leave a wrong entry: a sequence number that falls (the engine restarted), one
that skips (events lost), a batch that does not decode or does not fit (block size changed, token
count wrong) all clear the replica and start anew. A block whose parent it does not know (joined an
engine mid-stream, or after a clear) is skipped with its descendants: the index then misses a block
the engine holds, which costs a cache hit, never a wrong route.

Only one KV-cache group is indexed: the first full-attention group. Gemma 3 reports each stored block
once per group (five sliding-window groups and one full-attention group, each with its own hashes),
and a prefix hit is decided by the full-attention layers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from llmgw_common.kvcache import chain_key, request_salt, root_key
from llmgw_common.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

FULL_ATTENTION = "full_attention"
# Media tiers that are the engine's own KV cache (vLLM on CPU reports "GPU" too); an offloading tier's
# blocks ("CPU", "STORAGE") are not a prefix the engine reuses without a transfer.
INDEXED_MEDIA = frozenset({None, "GPU"})


def poisoned(parent: int, marks: tuple[Any, ...]) -> int:
    """The parent of a block that carries what a router never predicts (images, audio, prompt
    embeddings): a key no text prediction reaches, still distinct per input (the identifiers enter)."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8, person=b"llmgw-mm")
    h.update(repr(marks).encode())
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True, slots=True)
class Change:
    """What one batch did to a replica's key set: keys that appeared and disappeared (after ``cleared``,
    which empties the set first). A key that appeared and disappeared within the batch is in neither."""

    cleared: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    # Why the replica was cleared, for the one log line ("" when it was not, or the engine said so).
    reason: str = ""
    # Blocks skipped: parent unknown (joined mid-stream), another group or medium.
    orphans: int = 0

    @property
    def empty(self) -> bool:
        return not (self.cleared or self.stored or self.removed)


@dataclass
class ReplicaBlocks:
    """The blocks one engine holds, in llmgw keys, followed batch by batch."""

    block_size: int | None = None
    # The publisher's last sequence number; None before the first batch and after a lost one.
    last_seq: int | None = None
    # The KV-cache group indexed; None until a store names one (or when the engine names none).
    group: int | None = None
    by_hash: dict[int, int] = field(default_factory=dict)
    # key -> how many engine blocks carry it (two hashes can name one token prefix: an extra key that
    # llmgw does not model); the key leaves the set when the last one goes.
    refs: dict[int, int] = field(default_factory=dict)

    @property
    def keys(self) -> set[int]:
        return set(self.refs)

    def __len__(self) -> int:
        return len(self.refs)

    # ---------------------------------------------------------------- decisions

    def apply(self, seq: int, batch: EventBatch) -> Change:
        """Apply batch number ``seq`` of the replica's publisher."""
        reason = ""
        if self.last_seq is not None and seq <= self.last_seq:
            reason = f"sequence fell from {self.last_seq} to {seq}: the engine restarted"
        elif self.last_seq is not None and seq != self.last_seq + 1:
            reason = (
                f"sequence jumped from {self.last_seq} to {seq}: {seq - self.last_seq - 1} batch(es) lost"
            )
        self.last_seq = seq
        acc = _Acc(self)
        if reason:
            acc.clear()
        try:
            for ev in batch.events:
                if isinstance(ev, AllBlocksCleared):
                    acc.clear()
                elif isinstance(ev, BlockStored):
                    acc.store(ev)
                elif isinstance(ev, BlockRemoved):
                    acc.remove(ev)
        except _Unfit as e:
            # The batch contradicts what the replica said before: nothing of it is trusted.
            self.last_seq = seq
            acc = _Acc(self)
            acc.clear()
            reason = str(e)
        return acc.change(reason)

    def lost(self, why: str) -> Change:
        """A batch that could not be read (undecodable, foreign): its content is unknown, so clear."""
        self.last_seq = None
        acc = _Acc(self)
        acc.clear()
        return acc.change(why)


class _Unfit(Exception):
    """A decoded batch that cannot be this replica's (private: becomes a clear with its reason)."""


class _Acc:
    """One batch's effect on a :class:`ReplicaBlocks`, kept net of itself."""

    def __init__(self, r: ReplicaBlocks) -> None:
        self.r = r
        self.cleared = False
        self.stored: set[int] = set()
        self.removed: set[int] = set()
        self.orphans = 0

    def clear(self) -> None:
        r = self.r
        r.by_hash.clear()
        r.refs.clear()
        r.group = None
        r.block_size = None
        self.cleared = True
        self.stored.clear()
        self.removed.clear()

    def _add(self, key: int) -> None:
        n = self.r.refs.get(key, 0)
        self.r.refs[key] = n + 1
        if n == 0:
            if key in self.removed:
                self.removed.discard(key)
            else:
                self.stored.add(key)

    def _drop(self, key: int) -> None:
        n = self.r.refs.get(key, 0)
        if n > 1:
            self.r.refs[key] = n - 1
        elif n == 1:
            del self.r.refs[key]
            if key in self.stored:
                self.stored.discard(key)
            else:
                self.removed.add(key)

    def _indexed_group(self, group: int | None, kind: str | None) -> bool:
        if kind is not None and kind != FULL_ATTENTION:
            return False
        if self.r.group is None:
            self.r.group = group
        return group == self.r.group

    def store(self, ev: BlockStored) -> None:
        r = self.r
        n = len(ev.block_hashes)
        if len(ev.token_ids) != n * ev.block_size:
            raise _Unfit(f"a store of {n} block(s) of {ev.block_size} carries {len(ev.token_ids)} tokens")
        if ev.extra_keys is not None and len(ev.extra_keys) != n:
            raise _Unfit(f"a store of {n} block(s) carries {len(ev.extra_keys)} extra_keys entries")
        if ev.medium not in INDEXED_MEDIA or not self._indexed_group(ev.group_idx, ev.kv_cache_spec_kind):
            self.orphans += n
            return
        if r.block_size is None:
            r.block_size = ev.block_size
        elif r.block_size != ev.block_size:
            raise _Unfit(f"block size changed from {r.block_size} to {ev.block_size}")
        if ev.parent_block_hash is None:
            parent: int | None = None
        else:
            parent = r.by_hash.get(ev.parent_block_hash)
            if parent is None:
                # Its parent was never seen (joined mid-stream, or after a clear): skip the chain.
                self.orphans += n
                return
        bs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            extra = ev.extra_keys[i] if ev.extra_keys is not None else None
            if parent is None:
                parent = root_key(request_salt(ev.lora_name, _cache_salt(extra, ev.lora_name)))
            marks = _marks(extra, ev.lora_name, first=i == 0 and ev.parent_block_hash is None)
            if marks:
                parent = poisoned(parent, marks)
            key = chain_key(parent, ev.token_ids[i * bs : (i + 1) * bs])
            old = r.by_hash.get(h)
            if old != key:
                if old is not None:
                    self._drop(old)
                r.by_hash[h] = key
                self._add(key)
            parent = key

    def remove(self, ev: BlockRemoved) -> None:
        if ev.medium not in INDEXED_MEDIA:
            return
        # A remove names only its group: one of another group than the indexed one is not ours.
        if ev.group_idx is not None and self.r.group is not None and ev.group_idx != self.r.group:
            return
        for h in ev.block_hashes:
            key = self.r.by_hash.pop(h, None)
            if key is not None:
                self._drop(key)

    def change(self, reason: str) -> Change:
        return Change(
            cleared=self.cleared,
            stored=tuple(sorted(self.stored)),
            removed=tuple(sorted(self.removed)),
            reason=reason,
            orphans=self.orphans,
        )


def _cache_salt(extra: tuple[Any, ...] | None, lora_name: str | None) -> str | None:
    """The request's cache_salt among a first block's extra keys: its string, after the LoRA name
    (vLLM lists the LoRA name first when the request has one, then multimodal pairs, then the salt)."""
    if not extra:
        return None
    skipped_lora = lora_name is None
    for k in extra:
        if isinstance(k, str):
            if not skipped_lora and k == lora_name:
                skipped_lora = True
                continue
            return k
    return None


def _marks(extra: tuple[Any, ...] | None, lora_name: str | None, *, first: bool) -> tuple[Any, ...]:
    """What in a block's extra keys a router cannot predict: multimodal ``(identifier, offset)`` pairs,
    prompt-embedding digests. The LoRA name (in the salt) and, on a first block, the cache_salt are
    predicted; anything else marks the block."""
    if not extra:
        return ()
    salt = _cache_salt(extra, lora_name) if first else None
    out: list[Any] = []
    skipped_lora = lora_name is None
    skipped_salt = salt is None
    for k in extra:
        if isinstance(k, str) and not skipped_lora and k == lora_name:
            skipped_lora = True
        elif isinstance(k, str) and not skipped_salt and k == salt:
            skipped_salt = True
        else:
            out.append(k)
    return tuple(out)
