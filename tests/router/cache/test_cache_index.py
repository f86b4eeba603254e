"""The exact KV index (llmgw_router.cache.index): plain data in, longest cached prefixes out."""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_common.kvcache import ReplicaKv, block_keys
from llmgw_router.cache.index import KvIndex


def kv(
    replica: str,
    stored: list[int] | None = None,
    removed: list[int] | None = None,
    *,
    model: str = "m",
    block_size: int = 4,
    cleared: bool = False,
    gone: bool = False,
) -> ReplicaKv:
    return ReplicaKv(
        replica=replica,
        model=model,
        block_size=block_size,
        stored=stored or [],
        removed=removed or [],
        cleared=cleared,
        gone=gone,
    )


def test_match_is_each_replicas_longest_prefix() -> None:
    idx = KvIndex()
    keys = block_keys(list(range(40)), 4)  # 10 blocks
    idx.apply(kv("a", keys[:10]))
    idx.apply(kv("b", keys[:3]))
    idx.apply(kv("c", keys[1:10]))  # lacks the first block: nothing of it is reusable
    idx.apply(kv("d", keys[:2] + keys[4:8]))  # a hole after block 2: only 2 count
    assert idx.match("m", keys) == {"a": 10, "b": 3, "d": 2}
    assert idx.match("m", keys[:1]) == {"a": 1, "b": 1, "d": 1}
    assert idx.match("other", keys) == {}
    assert idx.match("m", []) == {}
    assert idx.match_one("m", "d", keys) == 2
    assert idx.match_one("m", "c", keys) == 0
    assert idx.match_one("other", "a", keys) == 0
    assert idx.block_size("m") == 4
    assert idx.block_size("other") is None


def test_models_never_share_blocks() -> None:
    idx = KvIndex()
    keys = block_keys(list(range(8)), 4)
    idx.apply(kv("a", keys, model="m1"))
    idx.apply(kv("b", keys, model="m2"))
    assert idx.match("m1", keys) == {"a": 2}
    assert idx.match("m2", keys) == {"b": 2}
    assert idx.blocks() == 4 and idx.blocks("m1") == 2 and idx.entries == 4


def test_removed_cleared_and_gone() -> None:
    idx = KvIndex()
    keys = block_keys(list(range(16)), 4)
    idx.apply(kv("a", keys))
    idx.apply(kv("b", keys))
    idx.apply(kv("a", removed=[keys[1]]))
    assert idx.match("m", keys) == {"a": 1, "b": 4}
    # Stored and removed in one batch: removed wins (never a wrong entry).
    idx.apply(kv("a", stored=[keys[1]], removed=[keys[1]]))
    assert idx.match_one("m", "a", keys) == 1
    # Cleared: everything before goes, then what the batch stores.
    idx.apply(kv("b", stored=keys[:2], cleared=True))
    assert idx.match("m", keys) == {"a": 1, "b": 2}
    assert idx.entries == 3 + 2
    idx.apply(kv("b", gone=True))
    assert idx.replicas("m") == ["a"] and idx.entries == 3
    # Removing what is not held, or from an unknown replica, changes nothing.
    idx.apply(kv("a", removed=[12345]))
    idx.drop("nobody")
    assert idx.entries == 3 and idx.dead_entries == 4 + 2  # b's 4, then its 2 after the clear
    while idx.sweep():
        pass
    assert idx.blocks() == 3 and idx.dead_entries == 0


def test_drop_frees_the_slot_and_a_new_replica_inherits_nothing() -> None:
    idx = KvIndex()
    keys = block_keys(list(range(12)), 4)
    idx.apply(kv("a", keys))
    idx.apply(kv("b", keys[:1]))
    idx.drop("a")
    idx.apply(kv("c", []))  # takes a's slot
    assert idx.match("m", keys) == {"b": 1}
    assert idx.replicas() == ["b", "c"]
    idx.drop("b")
    idx.drop("c")
    assert idx.replicas() == [] and idx.entries == 0 and idx.dead_entries == 4
    assert idx.match("m", keys) == {}
    # The bits go in budgets; then the model is gone too.
    assert idx.sweep(2) and idx.sweeping
    while idx.sweep(2):
        pass
    assert idx.blocks() == 0 and idx.dead_entries == 0 and idx.block_size("m") is None


def test_replace_is_a_snapshot_of_one_replica() -> None:
    idx = KvIndex()
    keys = block_keys(list(range(16)), 4)
    idx.apply(kv("a", keys))
    idx.replace("a", "m", 4, keys[:2])
    assert idx.match("m", keys) == {"a": 2} and idx.entries == 2


def test_a_replica_reported_under_another_model_starts_anew() -> None:
    idx = KvIndex()
    keys = block_keys(list(range(8)), 4)
    idx.apply(kv("a", keys, model="m1"))
    idx.apply(kv("a", keys[:1], model="m2"))
    assert idx.match("m1", keys) == {} and idx.match("m2", keys) == {"a": 1}
    assert idx.entries == 1


def test_retain_drops_replicas_not_listed() -> None:
    idx = KvIndex()
    idx.apply(kv("a", [1, 2]))
    idx.apply(kv("b", [1]))
    assert idx.retain(["b", "z"]) == ["a"]
    assert idx.replicas() == ["b"] and idx.entries == 1


def test_the_model_block_size_is_the_majoritys() -> None:
    idx = KvIndex()
    idx.apply(kv("a", [1], block_size=16))
    idx.apply(kv("b", [2], block_size=128))
    idx.apply(kv("c", [3], block_size=128))
    assert idx.block_size("m") == 128
    idx.drop("c")
    # A tie goes to the smaller size.
    assert idx.block_size("m") == 16


def test_the_cap_refuses_stores_and_frees_room_on_removal(caplog: pytest.LogCaptureFixture) -> None:
    idx = KvIndex(max_entries=5)
    keys = block_keys(list(range(40)), 4)
    idx.apply(kv("a", keys[:4]))
    idx.apply(kv("b", keys[:4]))
    assert idx.entries == 5 and idx.refused == 3
    assert idx.match("m", keys) == {"a": 4, "b": 1}
    assert sum("KV index full" in r.message for r in caplog.records) == 1
    idx.apply(kv("a", removed=keys[2:4]))
    idx.apply(kv("b", keys[1:3]))
    assert idx.match("m", keys) == {"a": 2, "b": 3} and idx.entries == 5
    with pytest.raises(ValueError):
        KvIndex(max_entries=-1)


class _Oracle:
    """The index's meaning, written the slow obvious way."""

    def __init__(self) -> None:
        self.sets: dict[str, set[int]] = {}

    def apply(self, r: ReplicaKv) -> None:
        if r.gone:
            self.sets.pop(r.replica, None)
            return
        s = self.sets.setdefault(r.replica, set())
        if r.cleared:
            s.clear()
        s.update(r.stored)
        s.difference_update(r.removed)

    def match(self, keys: list[int]) -> dict[str, int]:
        out = {}
        for rep, s in self.sets.items():
            n = 0
            while n < len(keys) and keys[n] in s:
                n += 1
            if n:
                out[rep] = n
        return out


_ops = st.lists(
    st.builds(
        lambda rep, stored, removed, cleared, gone: ReplicaKv(
            replica=rep, model="m", block_size=4, stored=stored, removed=removed, cleared=cleared, gone=gone
        ),
        st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]),
        st.lists(st.integers(0, 12), max_size=8),
        st.lists(st.integers(0, 12), max_size=4),
        st.sampled_from([False] * 6 + [True]),
        st.sampled_from([False] * 9 + [True]),
    ),
    max_size=40,
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(_ops, st.lists(st.integers(0, 12), max_size=10), st.lists(st.integers(0, 4), min_size=40, max_size=40))
def test_the_index_agrees_with_the_oracle(ops: list[ReplicaKv], query: list[int], sweeps: list[int]) -> None:
    """Whatever the order of changes, and whatever part of the sweep has run between them."""
    idx, oracle = KvIndex(), _Oracle()
    for op, budget in zip(ops, sweeps, strict=False):
        idx.apply(op)
        oracle.apply(op)
        if budget:
            idx.sweep(budget)
        assert idx.match("m", query) == oracle.match(query)
        for r in "abcdefghij":
            assert idx.keys_of(r) == oracle.sets.get(r, set())
            assert idx.match_one("m", r, query) == oracle.match(query).get(r, 0)
            # The counts too: a key listed twice in one batch, or shared, is counted once.
            assert idx.replica_blocks(r) == len(oracle.sets.get(r, set()))
        assert idx.entries == sum(len(s) for s in oracle.sets.values())
    assert idx.entries == sum(len(s) for s in oracle.sets.values())
    while idx.sweep(3):
        pass
    assert idx.dead_entries == 0 and not idx.sweeping
    assert idx.match("m", query) == oracle.match(query)
    held: set[int] = set().union(*oracle.sets.values())
    assert idx.blocks() == len(held)


def _measure(fill: Callable[[KvIndex], None]) -> int:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = KvIndex()
    fill(idx)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert idx.entries == 1_000_000
    return used


@pytest.mark.slow
def test_memory_per_million_blocks() -> None:
    """The figures in index.py's docstring. The keys are made inside the traced region, batch by batch,
    as decoded messages make them: the index keeps those int objects, so they are its cost."""
    import random

    def one_replica(idx: KvIndex) -> None:
        rnd = random.Random(7)
        for _ in range(100):
            batch = [rnd.getrandbits(64) | 1 << 63 for _ in range(10_000)]
            idx.apply(ReplicaKv(replica="a", model="m", block_size=16, stored=batch))

    def four_replicas(idx: KvIndex) -> None:
        rnd = random.Random(7)
        shared = [rnd.getrandbits(64) | 1 << 63 for _ in range(250_000)]
        for r in "abcd":
            for i in range(0, len(shared), 10_000):
                idx.apply(ReplicaKv(replica=r, model="m", block_size=16, stored=shared[i : i + 10_000]))
        shared.clear()

    one = _measure(one_replica)
    four = _measure(four_replicas)
    print(f"\none replica, 1M blocks: {one / 1e6:.1f} MB; 4 replicas x 250k shared: {four / 1e6:.1f} MB")
    assert 50e6 < one < 120e6
    assert four < one


@pytest.mark.slow
def test_match_and_apply_cost() -> None:
    """The figures in index.py's docstring, with a generous bound (a shared, loaded 2-core machine)."""
    idx = KvIndex()
    prompt = block_keys(list(range(2000)), 16)
    assert len(prompt) == 125
    for r in range(16):
        idx.apply(
            ReplicaKv(replica=f"r{r}", model="m", block_size=16, stored=prompt if r < 2 else prompt[:3])
        )
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        hits = idx.match("m", prompt)
    match_us = (time.perf_counter() - t0) / n * 1e6
    assert hits["r0"] == 125 and hits["r5"] == 3
    batches = [list(range(i * 1000 + 10**12, (i + 1) * 1000 + 10**12)) for i in range(100)]
    t0 = time.perf_counter()
    for b in batches:
        idx.apply(ReplicaKv(replica="r3", model="m", block_size=16, stored=b))
    apply_us = (time.perf_counter() - t0) / len(batches) * 1e6
    print(f"\nmatch 125 keys: {match_us:.1f} us; apply 1,000 stored: {apply_us:.0f} us")
    assert match_us < 200
    assert apply_us < 3000
