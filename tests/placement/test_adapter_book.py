"""A wake for a LoRA adapter, the agents' reports of adapters, and a base's demand with its adapters'
(issue 33): pure, on a fake clock."""

from __future__ import annotations

from dataclasses import replace

from llmgw_common.catalog import AdapterProfile, Catalog
from llmgw_common.messages import LoadReport, ReplicaLoad, ReplicaSpec, ShardState
from llmgw_common.router_messages import WakeReply, WakeState
from llmgw_controlplane.scheduler.adapter_book import (
    WANT_S,
    AdapterBook,
    adapter_wake_answer,
)
from llmgw_controlplane.scheduler.adapter_reports import AdapterReports
from llmgw_controlplane.scheduler.demand import Merged
from llmgw_controlplane.scheduler.snapshot import ReplicaView, Snapshot
from tests.placement.placement_kit import node, profile, replica, snap

BASE = profile("base", engine="sim", max_loras=2)
A1 = AdapterProfile(name="a1", base="base", weights="w-a1")


def _snap(replicas: list[ReplicaView], now: float = 1000.0) -> Snapshot:
    s = snap([node("n1", 0), node("n2", 0)], replicas, [BASE], now=now)
    return replace(s, catalog=Catalog(models=s.catalog.models, adapters=(A1,)))


def _r(rid: str, n: str, **kw: object) -> ReplicaView:
    return replica(rid, "base", [(n, ())], spec=ReplicaSpec.of(BASE), **kw)  # type: ignore[arg-type]


def _report(node_: str, rid: str, **kw: object) -> LoadReport:
    return LoadReport(node=node_, sent_at=0.0, replicas=(ReplicaLoad(replica_id=rid, **kw),))  # type: ignore[arg-type]


def _never() -> WakeReply:
    raise AssertionError("the base's wake must not be asked while a replica of it serves")


def _book(*reports: LoadReport, at: float = 999.0) -> AdapterBook:
    book = AdapterBook(AdapterReports(stale_s=10.0))
    for r in reports:
        book.reports.add(r, at)
    return book


def test_an_adapter_loaded_on_a_serving_replica_is_serving() -> None:
    book = _book(_report("n1", "r1", adapters=("a1",)))
    assert book.answer(_snap([_r("r1", "n1")]), A1, _never).state is WakeState.SERVING
    assert book.wants == {}


def test_an_adapter_loaded_nowhere_is_waking_and_wanted_for_a_while() -> None:
    book = _book()
    reply = book.answer(_snap([_r("r1", "n1")]), A1, _never)
    assert (reply.state, reply.reason) == (WakeState.WAKING, "loading on a replica of base")
    assert book.wanted(1000.0 + WANT_S - 1) == {"a1"}
    assert book.wanted(1000.0 + WANT_S) == frozenset()


def test_a_stale_report_does_not_say_serving() -> None:
    book = _book(_report("n1", "r1", adapters=("a1",)), at=900.0)
    assert book.answer(_snap([_r("r1", "n1")]), A1, _never).state is WakeState.WAKING


def test_an_adapter_whose_load_failed_on_every_replica_is_refused_with_the_error() -> None:
    err = {"a1": "no adapter weights at w-a1 on this node"}
    book = _book(_report("n1", "r1", adapter_errors=err), _report("n2", "r2", adapter_errors=err))
    reply = book.answer(_snap([_r("r1", "n1"), _r("r2", "n2")]), A1, _never)
    assert reply.state is WakeState.REFUSED
    assert reply.reason == (
        "adapter a1 could not be loaded on base base: no adapter weights at w-a1 on this node (replica r1)"
    )
    # One replica without the error may still load it.
    partly = _book(_report("n1", "r1", adapter_errors=err))
    assert partly.answer(_snap([_r("r1", "n1"), _r("r2", "n2")]), A1, _never).state is WakeState.WAKING


def test_a_base_at_zero_is_woken_and_its_refusal_is_the_adapters() -> None:
    asked: list[str] = []

    def base(state: WakeState, reason: str = "") -> WakeReply:
        asked.append("base")
        return WakeReply(model="base", state=state, reason=reason)

    s = _snap([])
    waking = adapter_wake_answer(s, A1, {}, lambda: base(WakeState.WAKING))
    assert (waking.state, waking.reason, asked) == (WakeState.WAKING, "its base base is waking", ["base"])
    refused = adapter_wake_answer(s, A1, {}, lambda: base(WakeState.REFUSED, "no node has an H100"))
    assert refused.state is WakeState.REFUSED
    assert refused.reason == "its base base cannot come: no node has an H100"
    # A starting replica of the base: the base is asked (it reports waking), not refused.
    starting = _snap([_r("r1", "n1", state=ShardState.STARTING, created=999.0)])
    assert adapter_wake_answer(starting, A1, {}, lambda: base(WakeState.WAKING)).state is WakeState.WAKING


def test_reports_count_as_news_only_when_loaded_adapters_or_errors_change() -> None:
    reports = AdapterReports(stale_s=10.0)
    assert not reports.add(_report("n1", "r1", running=1.0), 0.0)  # no adapters: nothing to tell
    assert reports.add(_report("n1", "r1", adapters=("a1",)), 1.0)
    assert not reports.add(_report("n1", "r1", adapters=("a1",), adapters_busy=("a1",)), 2.0)
    assert reports.add(_report("n1", "r1", adapter_errors={"a2": "rank 64 exceeds 16"}), 3.0)
    assert reports.changes == 2
    seen = reports.seen(3.0)["r1"]
    assert (seen.loaded, dict(seen.errors)) == (frozenset(), {"a2": "rank 64 exceeds 16"})
    assert reports.seen(13.1) == {}
    # Only shard 0 carries adapters.
    other = LoadReport(
        node="n1", sent_at=0.0, replicas=(ReplicaLoad(replica_id="r9", shard=1, adapters=("a1",)),)
    )
    assert not reports.add(other, 14.0) and "r9" not in reports.seen(14.0)


def _merged(in_flight: int, queued: int = 0, held: int = 0) -> Merged:
    return Merged(
        routers=1,
        in_flight=in_flight,
        queued=queued,
        held=held,
        replicas_reporting=1,
        running=2.0,
        waiting=0.0,
        kv_use=None,
        ttft_p90_ms=None,
        ttft_samples=0,
        window_s=30.0,
    )


def test_the_book_decides_from_the_stored_assignments_on_a_new_tenure() -> None:
    book = _book()
    s = _snap([_r("r1", "n1")], now=1000.0)
    d = book.decide(s, {"a1": _merged(1)}, lambda: {"r1": ("a1",)})
    assert dict(d.assigned) == {"r1": ("a1",)} and d.loads == ()
    loads = book.loads_for(s.catalog)
    assert [(x.name, x.weights) for x in loads["r1"]] == [("a1", "w-a1")]
    book.new_tenure()
    assert book.loads_for(s.catalog) == {}


def test_the_adapters_go_on_shard_0_and_change_no_engines_fingerprint() -> None:
    from llmgw_agent.converge import assignment_fingerprint
    from llmgw_common.messages import AdapterLoad, ReplicaRecord, ShardPlacement
    from llmgw_controlplane.apply import desired_assignments

    two = profile("base", engine="sim", max_loras=2, nodes=2)
    rec = ReplicaRecord(
        id="r1",
        model="base",
        created=0.0,
        shards=(ShardPlacement(shard=0, node="n1", port=1), ShardPlacement(shard=1, node="n2", port=2)),
        spec=ReplicaSpec.of(two),
    )
    cat = Catalog(models=(two,), adapters=(A1,))
    loads = {"r1": (AdapterLoad(name="a1", weights="w-a1"),)}
    before = desired_assignments({"r1": rec}, cat, {})
    after = desired_assignments({"r1": rec}, cat, {}, loads)
    assert after["n1"][0].adapters == loads["r1"] and after["n2"][0].adapters == ()
    assert (after["n1"][0].max_loras, after["n1"][0].max_lora_rank) == (2, 16)
    for n in ("n1", "n2"):
        assert assignment_fingerprint(before[n][0]) == assignment_fingerprint(after[n][0])


def test_a_rise_in_an_adapters_arrivals_is_a_use_since_the_last_pass() -> None:
    book = _book()
    s = _snap([_r("r1", "n1")], now=1000.0)
    book.decide(s, {"a1": replace(_merged(0), arrived=2)}, lambda: {"r1": ("a1",)})
    assert book.memo is not None and book.memo.used["a1"] == 1000.0  # from the stored assignment
    book.decide(replace(s, now=1100.0), {"a1": replace(_merged(0), arrived=2)}, dict)
    assert book.memo.used["a1"] == 1000.0  # the same arrivals: nothing new
    book.decide(replace(s, now=1200.0), {"a1": replace(_merged(0), arrived=3)}, dict)
    assert book.memo.used["a1"] == 1200.0


def test_a_watched_adapter_is_down_when_its_base_is_or_it_fails_to_load() -> None:
    from llmgw_common.catalog import WatchSpec
    from llmgw_controlplane.scheduler.adapter_book import adapter_watch

    watched = A1.model_copy(update={"watch": WatchSpec(budget=20.0)})
    s = _snap([_r("r1", "n1"), _r("r2", "n2")])
    s = replace(s, catalog=Catalog(models=s.catalog.models, adapters=(watched,)))
    ok = AdapterReports()
    assert adapter_watch(s, ok.seen(1000.0)) == ({"a1": 2}, {"a1": 20.0}, {})
    err = "missing weights: no LoRA adapter at w-a1"
    half = _book(_report("n1", "r1", adapter_errors={"a1": err})).reports.seen(1000.0)
    assert adapter_watch(s, half)[0] == {"a1": 1}
    both = _book(
        _report("n1", "r1", adapter_errors={"a1": err}), _report("n2", "r2", adapter_errors={"a1": err})
    ).reports.seen(1000.0)
    ready, _, why = adapter_watch(s, both)
    assert ready == {} and why == {"a1": f"adapter a1 could not be loaded on base base: {err} (replica r1)"}
    gone = replace(s, replicas=())
    assert adapter_watch(gone, {})[2] == {"a1": "its base base has no ready replica"}
    # Unwatched adapters are not judged.
    assert adapter_watch(_snap([_r("r1", "n1")]), {}) == ({}, {}, {})


def test_a_node_speaks_for_its_own_replicas_only() -> None:
    # n2 claims r1 (on n1) has a1 loaded: not believed; n1's own word is.
    forged = _book(_report("n2", "r1", adapters=("a1",)))
    s = _snap([_r("r1", "n1")])
    assert forged.seen(s) == {}
    assert forged.answer(s, A1, _never).state is WakeState.WAKING
    own = _book(_report("n1", "r1", adapters=("a1",)))
    assert set(own.seen(s)) == {"r1"} and own.answer(s, A1, _never).state is WakeState.SERVING
