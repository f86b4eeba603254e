"""The simulated engine's prefix cache: vLLM's block LRU, with the KV events vLLM reports of it (pure).

A request's tokens (:mod:`llmgw_common.simtokens`) are cut into blocks of ``block_size``; a full
block is named by a hash over its parent's hash, its tokens, the request's LoRA adapter (every block,
and ``lora_name`` in its events) and, for the first block, the request's ``cache_salt`` (vLLM's extra
keys). The hashes are the simulator's own, as an engine's are (64 bits
of BLAKE2b, not llmgw's ``chain_key``): a consumer must read the token ids the events carry.

What vLLM does, and so this (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``):
- :meth:`PrefixCache.begin` at admission: the longest run of the prompt's full blocks already cached
  is a hit, at most ``(tokens - 1) // block_size`` blocks (the last token is always computed, for
  its logits). The hit blocks are held, out of the LRU. ``queries`` counts the prompt's tokens,
  ``hits`` the hit's (``vllm:prefix_cache_queries`` / ``_hits``, in tokens).
- :meth:`PrefixCache.store` after the prefill: the prompt's new full blocks are cached and held,
  evicting the least recently used free block for each when full (never a held one: with none
  free, the rest of the prompt is not cached). Events: one ``BlockRemoved`` per evicted block, then
  one ``BlockStored`` per run of new blocks, with the parent's hash.
- :meth:`PrefixCache.finish`: the blocks the answer filled are cached too (the prompt and every
  generated token but the last, whose KV an engine never computes), then the request's blocks are
  freed, last block first, so that a conversation's tail is evicted before its head.
- :meth:`PrefixCache.reset`: vLLM's ``/reset_prefix_cache``, refused while a request holds blocks.
A block cached meanwhile by another request with the same prefix is shared, not stored twice (vLLM
would compute a second copy and report it again; a set of hashes reads the same either way).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmgw_common.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

# A full-attention model has one KV-cache group, which vLLM reports as group 0 of this kind, on the
# medium its block pool names (vLLM's default, "GPU", on CPU too).
GROUP_IDX = 0
SPEC_KIND = "full_attention"
MEDIUM = "GPU"

# Copied per block: cheaper than building a keyed hasher each time.
_HASHER = hashlib.blake2b(digest_size=8, person=b"llmgw-simblock")
# The parent of a first block: a fixed seed, as vLLM's (a constant unless PYTHONHASHSEED is set).
_ROOT = b"\x00" * 8


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    salt: str | None,
    known: Sequence[int] = (),
    lora: str | None = None,
) -> list[int]:
    """The hashes of every full block of ``tokens``; the first ``len(known)`` are ``known`` (the blocks
    of a prefix already hashed), the rest are computed after them."""
    # vLLM puts the LoRA adapter's name in every block's extra keys: an adapter's blocks are its own.
    lora_key = b"\x02" + lora.encode("utf-8", "surrogatepass") + b"\x00" if lora else b""
    out = list(known)
    width = 4 * block_size
    packed = array("I", tokens[len(out) * block_size :]).tobytes()
    parent = out[-1].to_bytes(8, "little") if out else _ROOT
    for end in range(width, len(packed) + 1, width):
        h = _HASHER.copy()
        h.update(parent)
        if lora_key:
            h.update(lora_key)
        if not out and salt:
            # vLLM puts the cache_salt in the first block's extra keys only.
            h.update(b"\x01" + salt.encode("utf-8", "surrogatepass") + b"\x00")
        h.update(packed[end - width : end])
        parent = h.digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def prefill_seconds(ttft_s: float, uncached_tokens: int, prefill_tokens_per_s: float | None) -> float:
    """The time to a request's first token: the fixed cost, plus its uncached tokens at the prefill
    speed (none without one)."""
    if prefill_tokens_per_s is None:
        return ttft_s
    return ttft_s + uncached_tokens / prefill_tokens_per_s


@dataclass(slots=True)
class Run:
    """One request's use of the cache, from admission to finish."""

    tokens: list[int]
    salt: str | None
    # The prompt's full blocks.
    hashes: list[int]
    hit_blocks: int
    block_size: int
    # The blocks it holds, always a prefix of its blocks (of the prompt, then of the answer).
    held: list[int] = field(default_factory=list)
    # The cache's epoch at admission: a reset in between leaves the request nothing to store or free.
    epoch: int = 0
    # The request's LoRA adapter (None: the base model).
    lora: str | None = None

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def uncached_tokens(self) -> int:
        return len(self.tokens) - self.hit_tokens


class PrefixCache:
    """A block LRU of ``capacity`` blocks of ``block_size`` tokens; see the module's docstring."""

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size {block_size} and capacity {capacity} must be >= 1")
        self.block_size = block_size
        self.capacity = capacity
        # Every cached block -> how many running requests hold it.
        self._refs: dict[int, int] = {}
        # The cached blocks no request holds, least recently used first: what eviction takes.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._epoch = 0
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, block: object) -> bool:
        return block in self._refs

    @property
    def held(self) -> int:
        """Blocks that running requests hold (never evicted)."""
        return len(self._refs) - len(self._free)

    def begin(self, tokens: list[int], salt: str | None = None, lora: str | None = None) -> Run:
        """Admit a request (for ``lora``, an adapter, or the base): its cache hit, whose blocks it now holds."""
        bs = self.block_size
        hashes = hash_blocks(tokens, bs, salt, lora=lora)
        limit = max(len(tokens) - 1, 0) // bs
        hit = 0
        for h in hashes[:limit]:
            if h not in self._refs:
                break
            hit += 1
        run = Run(tokens, salt, hashes, hit, bs, epoch=self._epoch, lora=lora)
        for h in hashes[:hit]:
            self._hold(h)
            run.held.append(h)
        self.queries += len(tokens)
        self.hits += hit * bs
        return run

    def store(self, run: Run) -> list[KvEvent]:
        """Cache the prompt's full blocks after its prefill; the events that says."""
        return self._store(run, run.hashes, run.tokens)

    def finish(self, run: Run, output: Sequence[int] = ()) -> list[KvEvent]:
        """The request ended: cache the blocks its ``output`` filled (none when it was cut short: pass
        nothing), then free its blocks."""
        events: list[KvEvent] = []
        if len(output) > 1 and run.epoch == self._epoch:
            seq = run.tokens + list(output[:-1])
            events = self._store(run, hash_blocks(seq, self.block_size, run.salt, run.hashes, run.lora), seq)
        self._release(run)
        return events

    def reset(self, force: bool = False) -> list[KvEvent] | None:
        """Drop every block (vLLM's reset_prefix_cache): ``[AllBlocksCleared]``, or None, refused,
        while a request holds blocks, unless ``force`` (vLLM's ``reset_running_requests``)."""
        if self.held and not force:
            return None
        self._refs.clear()
        self._free.clear()
        self._epoch += 1
        return [AllBlocksCleared()]

    # ------------------------------------------------------------ internals

    def _hold(self, h: int) -> None:
        self._refs[h] += 1
        self._free.pop(h, None)

    def _store(self, run: Run, hashes: list[int], seq: list[int]) -> list[KvEvent]:
        if run.epoch != self._epoch:
            return []
        removed: list[KvEvent] = []
        stored: list[tuple[int, int]] = []  # runs [a, b) of blocks new to the cache
        start = -1
        for i in range(len(run.held), len(hashes)):
            h = hashes[i]
            if h in self._refs:
                self._hold(h)
                if start >= 0:
                    stored.append((start, i))
                    start = -1
            else:
                if len(self._refs) >= self.capacity:
                    if not self._free:
                        break  # every block is held: the rest is not cached
                    victim, _ = self._free.popitem(last=False)
                    del self._refs[victim]
                    removed.append(BlockRemoved((victim,), group_idx=GROUP_IDX, medium=MEDIUM))
                self._refs[h] = 1
                if start < 0:
                    start = i
            run.held.append(h)
        if start >= 0:
            stored.append((start, len(run.held)))
        return removed + [self._stored(run, hashes, seq, a, b) for a, b in stored]

    def _stored(self, run: Run, hashes: list[int], seq: list[int], a: int, b: int) -> BlockStored:
        bs = self.block_size
        # vLLM's extra keys: the LoRA name first on every block, then the first block's cache_salt.
        lora = (run.lora,) if run.lora else ()
        extra = tuple((*lora, run.salt) if i == 0 and run.salt else (lora or None) for i in range(a, b))
        return BlockStored(
            block_hashes=tuple(hashes[a:b]),
            parent_block_hash=hashes[a - 1] if a else None,
            token_ids=tuple(seq[a * bs : b * bs]),
            block_size=bs,
            extra_keys=extra,
            group_idx=GROUP_IDX,
            kv_cache_spec_kind=SPEC_KIND,
            medium=MEDIUM,
            lora_name=run.lora,
        )

    def _release(self, run: Run) -> None:
        if run.epoch == self._epoch:
            # Last block first: the free list's oldest end is where eviction starts.
            for h in reversed(run.held):
                n = self._refs[h] - 1
                self._refs[h] = n
                if n == 0:
                    self._free[h] = None
        run.held = []
