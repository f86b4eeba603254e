"""The facade the request path calls (llmgw_router.cache.router): plain data, a clock passed in."""

from __future__ import annotations

import random
import time

from llmgw_common import simtokens
from llmgw_common.catalog import CacheRouting, ModelProfile
from llmgw_common.kvcache import ReplicaKv, block_keys
from llmgw_router.cache.index import KvIndex
from llmgw_router.cache.router import CacheLimits, PrefixRouting, text_units
from llmgw_router.cache.tokenizers import PromptTokenizer, SimPromptTokenizer
from tests.router.cache.cache_helpers import Ep


class Toks:
    def __init__(self, **by_model: PromptTokenizer) -> None:
        self.by_model = by_model

    def get(self, model: str) -> PromptTokenizer | None:
        return self.by_model.get(model)


class Lag:
    lag_by_model = {"sim": 0.012}


def chat(*turns: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    msgs = [{"role": "system", "content": "you are a careful assistant " * 20}]
    msgs += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"model": "sim", "messages": msgs}


def routing(**toks: PromptTokenizer) -> PrefixRouting:
    r = PrefixRouting(KvIndex(), Toks(**toks), CacheLimits(), lag=Lag())
    r.set_catalog(
        [
            ModelProfile(name="sim", engine="sim"),
            ModelProfile(name="gguf", engine="llamacpp"),
            ModelProfile(name="plain", engine="sim", cache_routing=CacheRouting.OFF),
        ]
    )
    return r


def test_modes_come_from_the_catalog() -> None:
    r = routing()
    assert r.mode("sim") is CacheRouting.EVENTS
    assert r.mode("gguf") is CacheRouting.APPROXIMATE
    assert r.mode("plain") is CacheRouting.OFF and r.mode("unknown") is CacheRouting.OFF
    assert r.prefix("plain", chat("hi"), None) is None
    assert r.prefix("unknown", chat("hi"), None) is None
    assert set(r.stats()) == {"sim", "gguf", "plain"}


def test_events_mode_routes_to_the_replica_the_events_say_holds_the_prefix() -> None:
    r = routing()
    body = chat("what is the capital of france")
    # No tokenizer yet: by load alone, counted.
    assert r.prefix("sim", body, None) is None and r.stats()["sim"].no_tokenizer == 1
    r.tokenizers = Toks(sim=SimPromptTokenizer())
    # A tokenizer, but no engine reported its block size yet.
    assert r.prefix("sim", body, None) is None and r.stats()["sim"].no_block_size == 1
    ids = simtokens.prompt_token_ids(body)
    assert ids is not None and len(ids) >= 64
    keys = block_keys(ids, 16)
    r.index.apply(ReplicaKv(replica="b", model="sim", block_size=16, stored=keys[:3]))
    r.index.apply(ReplicaKv(replica="c", model="sim", block_size=16, stored=keys))
    p = r.prefix("sim", body, None)
    assert p is not None and list(p.keys) == keys and p.block_size == 16 and p.prompt_tokens == len(ids)
    eps = [Ep("a"), Ep("b"), Ep("c")]
    for seed in range(20):
        assert r.choose("sim", eps, p, 10.0, random.Random(seed)) is eps[2]
    r.sent("sim", "c", p, 10.0)
    r.sent("sim", "b", p, 10.0)
    st = r.stats()["sim"]
    assert st.requests == 2 and st.prompt_tokens == 2 * len(ids)
    assert st.predicted_hit_tokens == len(keys) * 16 + 3 * 16
    assert r.index_blocks("sim") == len(keys) and r.event_lag_ms("sim") == 12.0
    # A salted request (another tenant) shares no block with the unsalted ones.
    salted = r.prefix("sim", body, "tenant-b")
    assert salted is not None and r.index.match("sim", salted.keys) == {}


def test_a_prompt_just_sent_counts_as_cached_there_until_the_events_come() -> None:
    """An agent's next step sent before the engine's events crossed the bus still finds its replica."""
    r = routing(sim=SimPromptTokenizer())
    r.index.apply(ReplicaKv(replica="x", model="sim", block_size=16, stored=[1]))  # the block size known
    first = r.prefix("sim", chat("step one"), None)
    nxt = r.prefix("sim", chat("step one", "done", "step two"), None)
    assert first is not None and nxt is not None
    eps = [Ep("a"), Ep("b"), Ep("c")]
    r.sent("sim", "b", first, 10.0)
    for seed in range(20):
        assert r.choose("sim", eps, nxt, 10.5, random.Random(seed)) is eps[1]
    # Never confirmed by an event: forgotten after the pending window, the choice is by load again.
    picks = {r.choose("sim", eps, nxt, 10.0 + 30.0, random.Random(seed)).replica_id for seed in range(40)}  # type: ignore[union-attr]
    assert picks == {"a", "b", "c"}


def test_an_unpredictable_prompt_goes_by_load() -> None:
    r = routing(sim=SimPromptTokenizer())
    r.index.apply(ReplicaKv(replica="a", model="sim", block_size=16, stored=[1]))
    assert r.prefix("sim", {"model": "sim", "messages": "not a list"}, None) is None
    assert r.stats()["sim"].unpredictable == 1
    # Without a prefix the choice is the router's P2C (here: the lighter of two).
    eps = [Ep("a", 3), Ep("b", 0)]
    assert r.choose("sim", eps, None, 0.0, random.Random(0)) is eps[1]
    r.sent("sim", "b", None, 0.0)
    assert r.stats()["sim"].requests == 0
    assert r.choose("sim", [], None, 0.0, random.Random(0)) is None


def test_approximate_mode_learns_from_its_own_decisions_and_forgets() -> None:
    r = routing()
    eps = [Ep(f"r{i}") for i in range(4)]
    first = chat("tell me about lighthouses")
    p1 = r.prefix("gguf", first, None)
    assert p1 is not None and p1.mode is CacheRouting.APPROXIMATE and len(p1.keys) >= 10
    went = r.choose("gguf", eps, p1, 0.0, random.Random(1))
    assert went is not None
    r.sent("gguf", went.replica_id, p1, 0.0)
    assert r.stats()["gguf"].predicted_hit_tokens == 0
    # The next turn re-sends the conversation: it goes where the first went, whatever the draw.
    second = chat("tell me about lighthouses", "they guide ships.", "and who keeps them?")
    p2 = r.prefix("gguf", second, None)
    assert p2 is not None
    for seed in range(20):
        assert r.choose("gguf", eps, p2, 1.0, random.Random(seed)) is went
    r.sent("gguf", went.replica_id, p2, 1.0)
    assert r.stats()["gguf"].predicted_hit_tokens > 0
    # Past the time to live (and a generation), nothing is remembered: P2C again.
    later = r.approx.ttl_s * 1.5 + 2
    assert r.approx.match("gguf", p2.keys, later) == {}
    # A replica that leaves the routing table is forgotten at once.
    r.sent("gguf", "r3", p2, later)
    r.retain(["r0", "r1", "r2"])
    assert r.approx.match("gguf", p2.keys, later) == {}


def test_approximate_mode_uses_the_tokenizer_where_there_is_one() -> None:
    r = routing(gguf=SimPromptTokenizer())
    body = chat("hello there")
    p = r.prefix("gguf", body, None)
    ids = simtokens.prompt_token_ids(body)
    assert p is not None and ids is not None
    assert list(p.keys) == block_keys(ids, 16) and p.prompt_tokens == len(ids)


def test_text_units_are_prefix_stable() -> None:
    a = text_units(chat("one"))
    b = text_units(chat("one", "two", "three"))
    assert a is not None and b is not None and b[: len(a) - 1] == a[:-1]
    assert text_units({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert text_units({"prompt": "abcdefgh"}) is not None
    assert text_units({"prompt": ["a", "b"]}) is None
    assert text_units({"prompt": [1, -1]}) is None
    assert text_units({}) is None


def test_the_request_path_costs() -> None:
    """prefix + choose + sent for a 2,000-token prompt in 16-token blocks, 16 replicas (sim tokenizer);
    the bound is generous for a shared machine: the figure is printed."""
    r = routing(sim=SimPromptTokenizer())
    words = " ".join(f"w{i}" for i in range(1990))
    body = {"model": "sim", "messages": [{"role": "user", "content": words}]}
    ids = simtokens.prompt_token_ids(body)
    assert ids is not None
    keys = block_keys(ids, 16)
    for i in range(16):
        r.index.apply(
            ReplicaKv(replica=f"r{i}", model="sim", block_size=16, stored=keys if i < 2 else keys[:5])
        )
    eps = [Ep(f"r{i}") for i in range(16)]
    rng = random.Random(0)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        p = r.prefix("sim", body, None)
        c = r.choose("sim", eps, p, 0.0, rng)
        assert c is not None
        r.sent("sim", c.replica_id, p, 0.0)
    per = (time.perf_counter() - t0) / n * 1e3
    print(f"\nprefix+choose+sent, 2,000 tokens, 16 replicas: {per:.3f} ms")
    assert per < 5.0
