"""Pure parts of the router: scheduling, breaker, admission, exemptions, landing, usage, keys, pool."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_common.messages import ApiKeyRecord, Endpoint, LoadReport, ReplicaLoad, RoutingEndpoints
from llmgw_router import landing
from llmgw_router.metrics import RouterMetrics
from llmgw_router.routing.breaker import Breaker, BreakerState
from llmgw_router.routing.endpoints import Pool
from llmgw_router.routing.scheduling import choose, load_score
from llmgw_router.tenancy.admission import AdmissionRefused, Gate
from llmgw_router.tenancy.auth import Exemptions, bearer_key
from llmgw_router.tenancy.keys import KeyTable, allows_model
from llmgw_router.tenancy.usage import UsageTable, find_usage
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import breaker_state

# ---------------------------------------------------------------- scheduling


@dataclass
class E:
    name: str
    in_flight: int = 0
    running: float | None = None
    waiting: float | None = None
    kv_use: float | None = None
    load_at: float | None = None


def test_stale_or_missing_load_falls_back_to_in_flight() -> None:
    fresh = E("a", in_flight=1, running=10, waiting=5, kv_use=0.5, load_at=100.0)
    assert load_score(fresh, now=101.0, stale_s=5.0) == 15.5
    # The same report, too old: ignored, never read as saturated.
    assert load_score(fresh, now=106.0, stale_s=5.0) == 1.0
    # Unknown running/waiting (None) are not zero-load claims beyond own in-flight.
    assert load_score(E("b", in_flight=3, load_at=100.0), now=100.0, stale_s=5.0) == 3.0


def test_choose_prefers_lighter_of_two_and_handles_small_lists() -> None:
    rng = random.Random(1)
    assert choose([], 0.0, 5.0, rng) is None
    one = E("x", in_flight=99)
    assert choose([one], 0.0, 5.0, rng) is one
    light, heavy = E("l", in_flight=0), E("h", in_flight=10)
    for _ in range(50):
        assert choose([light, heavy], 0.0, 5.0, rng) is light


@given(
    loads=st.lists(st.integers(min_value=0, max_value=50), min_size=2, max_size=12),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_choice_is_never_the_unique_heaviest(loads: list[int], seed: int) -> None:
    cands = [E(str(i), in_flight=n) for i, n in enumerate(loads)]
    got = choose(cands, 0.0, 5.0, random.Random(seed))
    assert got in cands
    heaviest = max(loads)
    if loads.count(heaviest) == 1:
        assert got.in_flight != heaviest or len(set(loads)) == 1


def test_power_of_two_spreads_over_equal_endpoints() -> None:
    cands = [E(str(i)) for i in range(4)]
    rng = random.Random(7)
    seen = {choose(cands, 0.0, 5.0, rng).name for _ in range(200)}  # type: ignore[union-attr]
    assert seen == {"0", "1", "2", "3"}


# ---------------------------------------------------------------- breaker


def test_breaker_opens_half_opens_and_closes() -> None:
    b = Breaker(threshold=2, cooldown_s=1.0, max_cooldown_s=4.0)
    assert b.acquire(0.0)
    b.failure(0.0)
    assert breaker_state(b) is BreakerState.CLOSED
    b.failure(0.1)
    assert breaker_state(b) is BreakerState.OPEN
    assert not b.allows(0.5) and not b.acquire(0.5)
    # Cool-down over: one probe at a time.
    assert b.allows(1.2)
    assert b.acquire(1.2)
    assert breaker_state(b) is BreakerState.HALF_OPEN
    assert not b.acquire(1.2)
    b.failure(1.3)  # probe failed: open again, longer cool-down (2 s)
    assert breaker_state(b) is BreakerState.OPEN
    assert not b.allows(2.5)
    assert b.acquire(3.4)
    b.success()
    assert breaker_state(b) is BreakerState.CLOSED and b.failures == 0
    assert b.acquire(3.5)


def test_breaker_abandoned_probe_frees_the_slot() -> None:
    b = Breaker(threshold=1, cooldown_s=1.0)
    b.failure(0.0)
    assert b.acquire(1.0)
    assert not b.acquire(1.0)
    b.abandon()
    assert b.acquire(1.0)


def test_success_resets_consecutive_failures() -> None:
    b = Breaker(threshold=2)
    b.failure(0.0)
    b.success()
    b.failure(0.0)
    assert b.state is BreakerState.CLOSED


# ---------------------------------------------------------------- admission


async def test_gate_queues_then_refuses_when_full() -> None:
    g = Gate("m", limit=1, max_queue=1, queue_timeout_s=5.0)
    assert g.try_enter()
    waiter = asyncio.create_task(g.enter())
    await asyncio.sleep(0)
    assert g.queued == 1
    with pytest.raises(AdmissionRefused) as e:
        await g.enter()
    assert "queue of 1 is full" in e.value.reason and e.value.retry_after >= 1
    g.leave()
    await asyncio.wait_for(waiter, 1.0)
    assert g.active == 1 and g.queued == 0
    g.leave()
    assert g.active == 0


async def test_gate_times_out_and_cancelled_waiter_leaves_no_trace() -> None:
    g = Gate("m", limit=1, max_queue=4, queue_timeout_s=0.05)
    assert g.try_enter()
    with pytest.raises(AdmissionRefused) as e:
        await g.enter()
    assert "waited 0.05s" in e.value.reason
    g.configure(1, 4, 10.0)
    t = asyncio.create_task(g.enter())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert g.queued == 0
    g.leave()
    assert g.active == 0


async def test_gate_without_limit_admits_everything() -> None:
    g = Gate("m", limit=None, max_queue=0, queue_timeout_s=0)
    for _ in range(100):
        await g.enter()
    assert g.active == 100


# ---------------------------------------------------------------- auth exemptions (ARCHITECTURE #11)

EXEMPT = Exemptions.parse(["/", "/health", "/healthz", "/static/"])


@pytest.mark.parametrize("path", ["/", "/health", "/healthz", "/static/app.css", "/static/a/b.js"])
def test_exempt_paths(path: str) -> None:
    assert EXEMPT.exempt(path)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "//",
        "/v1/",
        "/v1/chat/completions",
        "/health/",
        "/healthz/",
        "/healthz/../v1/models",
        "/health/../v1/models",
        "/static/../v1/models",
        "/static//x",
        "/static/./x",
        "/static/..",
        "/static",
        "/x",
        "",
        "/index.html",
        "/ ",
    ],
)
def test_not_exempt_paths(path: str) -> None:
    assert not EXEMPT.exempt(path)


def test_root_entry_is_never_a_prefix_rule() -> None:
    ex = Exemptions.parse(["/"])
    assert ex.exempt("/")
    assert not ex.exempt("/v1/models") and not ex.exempt("//")


def test_bearer_key_parsing() -> None:
    assert bearer_key({"Authorization": "Bearer abc"}) == "abc"
    assert bearer_key({"Authorization": "bearer  abc "}) == "abc"
    assert bearer_key({"Authorization": "Basic abc"}) is None
    assert bearer_key({"Authorization": "Bearer "}) is None
    assert bearer_key({"x-api-key": "k"}) == "k"
    assert bearer_key({}) is None


# ---------------------------------------------------------------- landing page (ARCHITECTURE #12)


def test_landing_base_url_from_forwarded_headers() -> None:
    h = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "llm.example.com", "X-Forwarded-Prefix": "/gw"}
    assert landing.display_base_url(h, "http", "10.0.0.1:8080") == "https://llm.example.com/gw/v1"
    assert landing.display_base_url({}, "http", "10.0.0.1:8080") == "http://10.0.0.1:8080/v1"


def test_landing_ignores_forwarded_values_that_are_not_a_host_or_path() -> None:
    h = {
        "X-Forwarded-Proto": "javascript",
        "X-Forwarded-Host": '"><script>alert(1)</script>',
        "X-Forwarded-Prefix": "/$(rm -rf ~)",
    }
    assert landing.display_base_url(h, "http", "h:1") == "http://h:1/v1"
    page = landing.render(landing.display_base_url(h, "http", "h:1"))
    assert "<script>" not in page and "rm -rf" not in page


def test_landing_escapes_whatever_it_is_given() -> None:
    page = landing.render('http://x/"><b>')
    assert '"><b>' not in page and "&quot;&gt;&lt;b&gt;" in page


# ---------------------------------------------------------------- usage


def test_find_usage_in_answer_and_stream_tail() -> None:
    body = b'{"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}'
    assert find_usage(body) == (12, 7)
    stream = (
        b'data: {"choices":[{"delta":{}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"total_tokens":8,"completion_tokens":5}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert find_usage(stream) == (3, 5)
    assert find_usage(b'data: {"usage":null}\n\ndata: [DONE]\n\n') is None
    assert find_usage(b'{"usage":{"prompt_tokens":4,"total_tokens":4}}') == (4, 0)
    assert find_usage(b"{}") is None


def test_usage_table_report() -> None:
    u = UsageTable(since=1.0)
    u.add("k1", "m", (3, 4))
    u.add("k1", "m", None)
    u.add("k2", "n", (1, 1))
    r = u.report("r1", 9.0)
    assert r.usage == {"k1": {"m": (2, 3, 4)}, "k2": {"n": (1, 1, 1)}}
    assert r.since == 1.0 and r.router == "r1"


# ---------------------------------------------------------------- keys


def _rec(key: str, **kw: Any) -> ApiKeyRecord:
    return ApiKeyRecord(id=kw.pop("id", "k1"), name="n", hash=hash_key(key), created=0.0, **kw)


def _problem(t: KeyTable, key: str | None, now: float) -> str:
    """Why ``t`` refuses ``key`` (failing the test if it accepts it)."""
    problem = t.check(key, now).problem
    assert problem is not None, f"{key!r} was accepted"
    return problem


def test_key_table_checks() -> None:
    k = generate_key()
    assert k.startswith("llmgw-") and len(k) > 40 and generate_key() != k
    t = KeyTable([_rec(k, models=("m1",))])
    assert t.check(k, 0.0).record is not None
    assert _problem(t, None, 0.0).startswith("no API key")
    assert _problem(t, "llmgw-wrong", 0.0) == "invalid API key"
    t.put(_rec(k, revoked=True))
    assert "revoked" in _problem(t, k, 0.0)
    t.put(_rec(k, expires=10.0))
    assert t.check(k, 9.0).record is not None
    assert "expired" in _problem(t, k, 10.0)
    t.remove("k1")
    assert t.check(k, 0.0).record is None and len(t) == 0
    assert allows_model(_rec(k, models=("m1",)), "m1") and not allows_model(_rec(k, models=("m1",)), "m2")
    assert allows_model(_rec(k), "anything") and allows_model(None, "x")


def test_key_table_replacing_a_record_drops_its_old_hash() -> None:
    t = KeyTable([_rec("old-key")])
    t.put(_rec("new-key"))
    assert t.check("old-key", 0.0).record is None
    assert t.check("new-key", 0.0).record is not None


# ---------------------------------------------------------------- pool


def _eps(*pairs: tuple[str, str], draining: frozenset[str] = frozenset()) -> RoutingEndpoints:
    out: dict[str, list[Endpoint]] = {}
    for rid, url in pairs:
        out.setdefault("m", []).append(
            Endpoint(replica_id=rid, model="m", url=url, node="n", draining=rid in draining)
        )
    return RoutingEndpoints(version=1, endpoints={k: tuple(v) for k, v in out.items()})


def test_pool_keeps_live_state_across_unrelated_updates() -> None:
    p = Pool()
    p.set_endpoints(_eps(("r1", "http://a:1"), ("r2", "http://b:1")))
    a = p.by_key[("r1", "http://a:1")]
    a.in_flight = 3
    a.breaker.failure(0.0)
    a.observe_latency(0.5)
    p.set_endpoints(_eps(("r1", "http://a:1"), ("r2", "http://b:1"), ("r3", "http://c:1")))
    same = p.by_key[("r1", "http://a:1")]
    assert same is a and same.in_flight == 3 and same.breaker.failures == 1 and same.ewma_latency_s == 0.5
    # An endpoint that leaves is no longer routable, but a holder's reference still works.
    p.set_endpoints(_eps(("r2", "http://b:1")))
    assert [e.replica_id for e in p.routable("m", 0.0)] == ["r2"]
    a.in_flight -= 1
    assert a.in_flight == 2
    # Same replica id, new URL (restarted elsewhere): fresh state.
    p.set_endpoints(_eps(("r1", "http://a:2")))
    assert p.by_key[("r1", "http://a:2")].in_flight == 0


def test_pool_returns_withdrawn_endpoints_but_not_draining_ones() -> None:
    p = Pool()
    abc = (("r1", "http://a:1"), ("r2", "http://b:1"), ("r3", "http://c:1"))
    p.set_endpoints(_eps(*abc))
    a, b, c = (p.by_key[("r1", "http://a:1")], p.by_key[("r2", "http://b:1")], p.by_key[("r3", "http://c:1")])
    a.answers.add(cast(Any, object()))
    b.answers.add(cast(Any, object()))
    # Draining keeps an endpoint in the set: it finishes what it holds.
    assert p.set_endpoints(_eps(*abc, draining=frozenset({"r1"}))) == []
    # r2 withdrawn with an answer in flight, r3 withdrawn idle: both are returned, to be marked withdrawn.
    assert p.set_endpoints(_eps(("r1", "http://a:1"), draining=frozenset({"r1"}))) == [b, c]


def test_draining_endpoints_take_no_new_requests_and_load_reports_apply() -> None:
    p = Pool()
    p.set_endpoints(_eps(("r1", "http://a:1"), ("r2", "http://b:1"), draining=frozenset({"r1"})))
    assert [e.replica_id for e in p.routable("m", 0.0)] == ["r2"]
    p.apply_load(
        LoadReport(node="n", sent_at=0.0, replicas=(ReplicaLoad(replica_id="r2", running=4, waiting=1),)),
        50.0,
    )
    r2 = p.by_key[("r2", "http://b:1")]
    assert (r2.running, r2.waiting, r2.kv_use, r2.load_at) == (4, 1, None, 50.0)
    assert "draining" in Pool.why_unavailable(_only_draining(), "m", 0.0)


def _only_draining() -> Pool:
    p = Pool()
    p.set_endpoints(_eps(("r1", "http://a:1"), draining=frozenset({"r1"})))
    return p


def test_unavailable_reason_comes_from_routing() -> None:
    p = Pool()
    p.set_endpoints(RoutingEndpoints(version=2, unavailable={"m": "needs 2 x H100-80GB, 0 free"}))
    assert p.why_unavailable("m", 0.0) == "model 'm' has no ready replica: needs 2 x H100-80GB, 0 free"


def test_metrics_exposition_counts_buckets_like_prometheus() -> None:
    m = RouterMetrics(Pool(), {})
    m.in_flight = 2
    # 0.005 is a bound: it belongs to le="0.005" (Prometheus buckets are "less or equal").
    for v in (0.001, 0.005, 0.0051, 500.0):
        m.request("a", 200, v)
    m.first_byte("a", 0.001)
    m.request("-", 404)
    m.retry("a")
    text = m.exposition().decode()
    assert 'llmgw_router_request_seconds_bucket{le="0.005",model="a"} 2.0' in text
    assert 'llmgw_router_request_seconds_bucket{le="0.01",model="a"} 3.0' in text
    assert 'llmgw_router_request_seconds_bucket{le="300.0",model="a"} 3.0' in text
    assert 'llmgw_router_request_seconds_bucket{le="+Inf",model="a"} 4.0' in text
    assert 'llmgw_router_request_seconds_count{model="a"} 4.0' in text
    assert 'llmgw_router_request_seconds_sum{model="a"} 500.0111' in text
    assert 'llmgw_router_ttft_seconds_bucket{le="0.001",model="a"} 1.0' in text
    assert 'llmgw_router_requests_total{model="a",status="200"} 4.0' in text
    assert 'llmgw_router_requests_total{model="-",status="404"} 1.0' in text
    assert 'llmgw_router_requests_created{model="-",status="404"}' in text
    assert 'llmgw_router_retries_total{model="a"} 1.0' in text
    assert "llmgw_router_in_flight 2.0" in text
    assert "# TYPE llmgw_router_request_seconds histogram" in text
    assert m.requests_count("a", 200) == 4 and m.requests_count("a", 500) == 0
    assert m.retries_count("a") == 1 and m.retries_count("b") == 0
