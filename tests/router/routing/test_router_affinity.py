"""Prefix-aware routing: a stable key per conversation, bounded-load rendezvous hashing over replicas."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_router.routing.affinity import prompt_key
from llmgw_router.routing.scheduling import choose_affine, stable_id
from tests.router.router_helpers import EngineFactory, RouterFactory, StaticFile


@dataclass
class R:
    name: str
    in_flight: int = 0
    affinity_id: int = field(init=False)

    def __post_init__(self) -> None:
        self.affinity_id = stable_id(self.name)


def _replicas(n: int) -> list[R]:
    return [R(f"replica-{i}") for i in range(n)]


# ---------------------------------------------------------------- the choice


def test_same_key_same_replica_whatever_the_candidates_order() -> None:
    reps = _replicas(5)
    rng = random.Random(7)
    for key in range(200):
        first = choose_affine(reps, key, 1.25)
        shuffled = reps[:]
        rng.shuffle(shuffled)
        assert choose_affine(shuffled, key, 1.25) is first


def test_keys_spread_over_idle_replicas() -> None:
    reps = _replicas(4)
    counts = dict.fromkeys((r.name for r in reps), 0)
    for key in range(4000):
        chosen = choose_affine(reps, stable_id(f"conversation {key}"), 1.25)
        assert chosen is not None
        counts[chosen.name] += 1
    assert all(700 < c < 1300 for c in counts.values()), counts


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    reps = _replicas(4)
    keys = [stable_id(f"k{i}") for i in range(1000)]
    before = {k: choose_affine(reps, k, 1.25) for k in keys}
    gone = reps[2]
    rest = [r for r in reps if r is not gone]
    for k in keys:
        if before[k] is not gone:
            assert choose_affine(rest, k, 1.25) is before[k]


def test_no_candidates() -> None:
    assert choose_affine([], 1, 1.25) is None


def test_one_hot_key_spills_over_within_the_bound() -> None:
    reps = _replicas(4)
    for total in range(1, 101):
        chosen = choose_affine(reps, 12345, 1.25)
        assert chosen is not None
        chosen.in_flight += 1
        assert max(r.in_flight for r in reps) <= math.ceil(1.25 * total / 4)
    # It still prefers its own replica as far as the bound lets it.
    assert max(r.in_flight for r in reps) == math.ceil(1.25 * 100 / 4)


_events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 30)), st.tuples(st.just("leave"), st.integers(0, 10**6))
    ),
    min_size=1,
    max_size=300,
)


@given(
    n=st.integers(1, 8),
    load_factor=st.floats(1.0, 3.0, allow_nan=False),
    events=_events,
)
@pytest.mark.slow
def test_no_replica_takes_more_than_its_bounded_share(
    n: int, load_factor: float, events: list[tuple[str, int]]
) -> None:
    """At each arrival the chosen replica, counting the new request, holds at most
    ceil(load_factor x in-flight / replicas); with arrivals only, that holds for every replica always."""
    reps = _replicas(n)
    arrivals_only = True
    for kind, k in events:
        if kind == "leave":
            busy = [r for r in reps if r.in_flight]
            if busy:
                busy[k % len(busy)].in_flight -= 1
                arrivals_only = False
            continue
        chosen = choose_affine(reps, stable_id(str(k)), load_factor)
        assert chosen is not None
        chosen.in_flight += 1
        total = sum(r.in_flight for r in reps)
        bound = math.ceil(load_factor * total / n)
        assert chosen.in_flight <= bound
        if arrivals_only:
            assert max(r.in_flight for r in reps) <= bound


@given(loads=st.lists(st.integers(0, 20), min_size=1, max_size=8), key=st.integers(0, 2**64 - 1))
def test_the_preferred_replica_is_taken_while_under_the_bound(loads: list[int], key: int) -> None:
    reps = _replicas(len(loads))
    for r, load in zip(reps, loads, strict=True):
        r.in_flight = load
    chosen = choose_affine(reps, key, 1.25)
    assert chosen is not None
    idle = _replicas(len(loads))
    preferred = choose_affine(idle, key, 1.25)
    assert preferred is not None
    pref = reps[idle.index(preferred)]
    bound = math.ceil(1.25 * (sum(loads) + 1) / len(loads))
    if pref.in_flight + 1 <= bound:
        assert chosen is pref


# ---------------------------------------------------------------- the key


def _chat(*turns: tuple[str, str], system: str | None = "You are terse.") -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    msgs += [{"role": role, "content": text} for role, text in turns]
    return {"model": "m", "messages": msgs}


def test_every_turn_of_a_conversation_has_the_same_key() -> None:
    t1 = _chat(("user", "Plan a trip to Lyon"))
    t2 = _chat(("user", "Plan a trip to Lyon"), ("assistant", "Day 1: ..."), ("user", "And day 2?"))
    t3 = _chat(
        ("user", "Plan a trip to Lyon"),
        ("assistant", "Day 1: ..."),
        ("user", "And day 2?"),
        ("assistant", "Day 2: ..."),
        ("user", "Restaurants?"),
    )
    assert prompt_key(t1) == prompt_key(t2) == prompt_key(t3) is not None
    assert prompt_key(_chat(("user", "Plan a trip to Nice"))) != prompt_key(t1)
    assert prompt_key(_chat(("user", "Plan a trip to Lyon"), system="Be verbose.")) != prompt_key(t1)


def test_content_parts_and_completions_prompts_have_keys() -> None:
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    plain = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert prompt_key(parts) == prompt_key(plain) is not None
    long = "x" * 5000
    assert prompt_key({"model": "m", "prompt": long + "a"}) == prompt_key(
        {"model": "m", "prompt": long + "b"}
    )
    assert prompt_key({"model": "m", "prompt": "a"}) != prompt_key({"model": "m", "prompt": "b"})
    assert prompt_key({"model": "m", "prompt": ["abc"]}) == prompt_key({"model": "m", "prompt": "abc"})


def test_requests_without_a_prompt_have_no_key() -> None:
    assert prompt_key({"model": "m"}) is None
    assert prompt_key({"model": "m", "messages": "not a list"}) is None
    assert prompt_key({"model": "m", "messages": [{"role": "user", "content": 3}]}) is None
    assert prompt_key({"model": "m", "input": "embed me"}) is None


# ---------------------------------------------------------------- through a router


async def _served(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    m = re.search(r"^vllm:request_success_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert m, text
    return int(float(m.group(1)))


async def test_a_conversation_sticks_to_one_replica_through_the_router(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile
) -> None:
    a, b = await engines("m1"), await engines("m1")
    r = await routers(static_file({"m1": [a.url, b.url]}, auth=False), prefix_affinity=True)
    url = f"http://127.0.0.1:{r.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        for conversation in range(6):
            turns: list[tuple[str, str]] = [("user", f"conversation {conversation}")]
            before = (await _served(a.url), await _served(b.url))
            for _ in range(4):
                async with s.post(url, json={**_chat(*turns), "model": "m1", "max_tokens": 2}) as resp:
                    assert resp.status == 200
                    await resp.read()
                turns += [("assistant", "ok"), ("user", "more")]
            after = (await _served(a.url), await _served(b.url))
            assert sorted(x - y for x, y in zip(after, before, strict=True)) == [0, 4]
