"""The simulator's prefix cache, pure: hits and misses, LRU eviction order, salts, held blocks, the
capacity bound, the events vLLM would send, and the prefill time of the uncached tokens."""

from __future__ import annotations

import random

import pytest

from llmgw_common.kvcache import block_keys
from llmgw_common.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from llmgw_sim.prefix_cache import GROUP_IDX, SPEC_KIND, PrefixCache, Run, hash_blocks, prefill_seconds

BS = 4


def served(
    cache: PrefixCache, tokens: list[int], salt: str | None = None, output: list[int] | None = None
) -> Run:
    """One request from admission to its end, as the engine runs it."""
    run = cache.begin(tokens, salt)
    cache.store(run)
    cache.finish(run, output or [])
    return run


def stored(events: list[KvEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def removed(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_a_cold_prompt_misses_and_the_same_prompt_then_hits() -> None:
    cache = PrefixCache(BS, 64)
    tokens = list(range(1, 11))  # 2 full blocks and 2 tokens
    first = served(cache, tokens)
    assert (first.hit_blocks, first.uncached_tokens) == (0, 10)
    second = served(cache, tokens)
    assert (second.hit_blocks, second.hit_tokens, second.uncached_tokens) == (2, 8, 2)
    # vLLM's counters, in tokens: every prompt token is queried; the hit's tokens are hits.
    assert (cache.queries, cache.hits) == (20, 8)
    # A prompt that shares only the first block hits that block.
    other = served(cache, [1, 2, 3, 4, 99, 98, 97, 96, 95])
    assert other.hit_blocks == 1


def test_the_last_token_is_always_computed() -> None:
    # A prompt of exactly two blocks can hit only the first: vLLM recomputes the last token's block.
    cache = PrefixCache(BS, 64)
    tokens = list(range(8))
    served(cache, tokens)
    assert served(cache, tokens).hit_blocks == 1
    assert served(cache, [*tokens, 100]).hit_blocks == 2


def test_eviction_takes_the_least_recently_used_and_a_request_tail_first() -> None:
    cache = PrefixCache(BS, 4)
    a = served(cache, list(range(100, 109)))  # blocks a0 a1
    b = served(cache, list(range(200, 209)))  # blocks b0 b1
    assert len(cache) == 4
    # Touch a: its blocks become the most recently used.
    assert served(cache, list(range(100, 109))).hit_blocks == 2
    c = cache.begin(list(range(300, 309)))
    events = cache.store(c)
    # b is the oldest; its tail block goes before its head (freed last block first).
    assert removed(events) == [b.hashes[1], b.hashes[0]]
    assert [s.block_hashes for s in stored(events)] == [tuple(c.hashes)]
    # vLLM's order within a step: the evictions of the allocation, then the store.
    assert isinstance(events[0], BlockRemoved) and isinstance(events[-1], BlockStored)
    cache.finish(c)
    assert a.hashes[0] in cache and b.hashes[0] not in cache


def test_a_running_requests_blocks_are_never_evicted() -> None:
    cache = PrefixCache(BS, 3)
    running = cache.begin(list(range(13)))  # 3 full blocks: the whole cache
    assert len(stored(cache.store(running))) == 1
    assert cache.held == 3
    other = cache.begin(list(range(50, 63)))
    events = cache.store(other)
    # Nothing free: nothing evicted, and the newcomer's blocks are not cached.
    assert events == [] and removed(events) == []
    assert all(h in cache for h in running.hashes) and not any(h in cache for h in other.hashes)
    cache.finish(other)
    cache.finish(running)
    # Free now: the next store evicts them, least recently used first.
    late = cache.begin(list(range(70, 75)))
    assert removed(cache.store(late)) == [running.hashes[2]]


def test_capacity_is_never_exceeded() -> None:
    rng = random.Random(7)
    cache = PrefixCache(BS, 10)
    live: list[Run] = []
    for _ in range(400):
        if live and rng.random() < 0.5:
            cache.finish(
                live.pop(rng.randrange(len(live))), [rng.randrange(9) for _ in range(rng.randrange(6))]
            )
        else:
            # Few distinct prefixes, so that hits, shared blocks and evictions all happen.
            prefix = [rng.randrange(3)] * rng.randrange(1, 12)
            run = cache.begin(prefix + [rng.randrange(5) for _ in range(rng.randrange(8))])
            cache.store(run)
            live.append(run)
        assert len(cache) <= 10
        assert cache.held <= len(cache)
    for run in live:
        cache.finish(run)
    assert cache.held == 0
    assert cache.hits > 0


def test_a_cache_salt_keeps_prefixes_apart() -> None:
    cache = PrefixCache(BS, 64)
    tokens = list(range(9))
    plain = served(cache, tokens)
    salted = cache.begin(tokens, "tenant-a")
    assert salted.hit_blocks == 0
    events = cache.store(salted)
    cache.finish(salted)
    # Only the first block's hash takes the salt, but every later block hangs from it.
    assert not set(salted.hashes) & set(plain.hashes)
    (ev,) = stored(events)
    # vLLM reports the salt in the first block's extra keys, none for the rest.
    assert ev.extra_keys == (("tenant-a",), None)
    assert served(cache, tokens, "tenant-a").hit_blocks == 2
    assert served(cache, tokens, "tenant-b").hit_blocks == 0
    assert stored(cache.store(cache.begin(list(range(20, 29)))))[0].extra_keys == (None, None)


def test_stored_events_carry_the_tokens_and_chain_to_their_parent() -> None:
    cache = PrefixCache(BS, 64)
    head = list(range(1, 10))
    first = cache.begin(head)
    (e1,) = stored(cache.store(first))
    assert e1.parent_block_hash is None
    assert e1.token_ids == tuple(head[:8]) and e1.block_hashes == tuple(first.hashes)
    assert (e1.block_size, e1.group_idx, e1.kv_cache_spec_kind, e1.medium) == (
        BS,
        GROUP_IDX,
        SPEC_KIND,
        "GPU",
    )
    cache.finish(first)
    longer = cache.begin([*head, 11, 12, 13, 14])
    assert longer.hit_blocks == 2
    (e2,) = stored(cache.store(longer))
    # Only the new block, hung from the hit's last block.
    assert e2.parent_block_hash == first.hashes[-1]
    assert e2.block_hashes == (longer.hashes[2],)
    assert e2.token_ids == (9, 11, 12, 13)


def test_the_answer_fills_blocks_the_next_turn_hits() -> None:
    cache = PrefixCache(BS, 64)
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [7, 8, 9, 10, 11]
    run = cache.begin(prompt)
    cache.store(run)
    events = cache.finish(run, answer)
    (ev,) = stored(events)
    # prompt + the answer but its last token (never computed): 10 tokens, 2 full blocks, 1 new.
    assert ev.token_ids == (5, 6, 7, 8) and ev.parent_block_hash == run.hashes[0]
    nxt = cache.begin([*prompt, *answer, 20, 21])
    assert nxt.hit_blocks == 2
    # An answer cut short (cancelled) caches nothing more.
    cut = cache.begin([40, 41, 42, 43, 44])
    cache.store(cut)
    assert cache.finish(cut, []) == []


def test_blocks_cached_meanwhile_by_another_request_are_shared() -> None:
    cache = PrefixCache(BS, 64)
    tokens = list(range(9))
    a, b = cache.begin(tokens), cache.begin(tokens)
    assert len(stored(cache.store(a))) == 1
    assert cache.store(b) == []  # a stored them first: b holds them too, nothing new to report
    cache.finish(a)
    assert cache.held == 2
    cache.finish(b)
    assert cache.held == 0


def test_reset_is_refused_while_blocks_are_held_unless_forced() -> None:
    cache = PrefixCache(BS, 64)
    served(cache, list(range(9)))
    running = cache.begin(list(range(100, 109)))
    cache.store(running)
    assert cache.reset() is None and len(cache) == 4
    assert cache.reset(force=True) == [AllBlocksCleared()]
    assert len(cache) == 0
    # The request admitted before the reset neither stores nor frees anything after it.
    assert cache.finish(running, [1, 2, 3, 4, 5, 6]) == []
    assert cache.held == 0 and len(cache) == 0
    assert cache.reset() == [AllBlocksCleared()]


def test_hashes_are_the_engines_own_and_continue_from_a_known_prefix() -> None:
    tokens = list(range(30))
    full = hash_blocks(tokens, BS, "s")
    assert hash_blocks(tokens, BS, "s", full[:3]) == full
    assert len(full) == 7 and len(set(full)) == 7
    # Not llmgw's chain keys: an agent translates engine hashes, as it must for vLLM.
    assert not set(full) & set(block_keys(tokens, BS))
    assert hash_blocks(tokens, BS, None) != full


def test_prefill_time_is_the_fixed_cost_plus_uncached_tokens() -> None:
    assert prefill_seconds(0.05, 1000, None) == 0.05
    assert prefill_seconds(0.05, 1000, 2000.0) == pytest.approx(0.55)
    cache = PrefixCache(16, 1024)
    tokens = list(range(1000))
    cold = served(cache, tokens)
    warm = served(cache, tokens)
    assert prefill_seconds(0.05, cold.uncached_tokens, 2000.0) == pytest.approx(0.55)
    # 62 of 62 full blocks hit: 992 cached, 8 computed.
    assert warm.uncached_tokens == 8
    assert prefill_seconds(0.05, warm.uncached_tokens, 2000.0) == pytest.approx(0.054)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0, 10)
    with pytest.raises(ValueError):
        PrefixCache(16, 0)
