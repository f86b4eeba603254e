"""LoRA adapters in the router's pool (issue 33), pure: which endpoints hold an adapter (the latest load
report's), when it is ready, why not, what a held request for it can expect, and the one choice that
only ever picks a holder."""

from __future__ import annotations

import random

from llmgw_common.catalog import AdapterProfile, Catalog, ModelProfile
from llmgw_common.messages import Endpoint, LoadReport, ReplicaLoad, RoutingEndpoints
from llmgw_router.holding import Prospect, prospect
from llmgw_router.routing.endpoints import EndpointState, Pool
from llmgw_router.routing.pick import Choosing, pick

CATALOG = Catalog(
    models=(ModelProfile(name="m1", engine="sim", max_loras=2), ModelProfile(name="m2", engine="sim")),
    adapters=(
        AdapterProfile(name="a1", base="m1", weights="/w/a1"),
        AdapterProfile(name="a2", base="m1", weights="/w/a2"),
    ),
)


def _pool(replicas: int = 3, **routing: object) -> Pool:
    pool = Pool()
    pool.set_catalog(CATALOG)
    eps = tuple(
        Endpoint(replica_id=f"r{i}", model="m1", url=f"http://127.0.0.1:{9000 + i}", node="n1")
        for i in range(replicas)
    )
    pool.set_endpoints(RoutingEndpoints(version=1, endpoints={"m1": eps} if eps else {}, **routing))  # type: ignore[arg-type]
    return pool


def _report(**replicas: tuple[tuple[str, ...], dict[str, str]]) -> LoadReport:
    return LoadReport(
        node="n1",
        sent_at=0.0,
        replicas=tuple(
            ReplicaLoad(replica_id=r, running=0, waiting=0, adapters=held, adapter_errors=errors)
            for r, (held, errors) in replicas.items()
        ),
    )


def _ids(eps: list[EndpointState]) -> list[str]:
    return sorted(e.replica_id for e in eps)


def test_holders_are_the_base_endpoints_whose_latest_report_lists_the_adapter() -> None:
    pool = _pool()
    assert "m1" in pool.ready and "a1" not in pool.ready
    assert pool.apply_load(_report(r1=(("a1",), {}), r2=(("a1", "a2"), {})), 1.0) is True
    assert _ids(pool.holders("a1")) == ["r1", "r2"] and _ids(pool.holders("a2")) == ["r2"]
    assert {"a1", "a2"} <= pool.ready
    # The same report again changes nothing (no held request is woken for it).
    assert pool.apply_load(_report(r1=(("a1",), {}), r2=(("a1", "a2"), {})), 2.0) is False
    # The latest report is what counts: r2 unloaded a2.
    assert pool.apply_load(_report(r2=(("a1",), {})), 3.0) is True
    assert pool.holders("a2") == [] and "a2" not in pool.ready and "a1" in pool.ready
    # A model's name is not an adapter's: nothing holds a model.
    assert pool.holders("m1") == []


def test_a_draining_holder_does_not_make_the_adapter_ready() -> None:
    pool = Pool()
    pool.set_catalog(CATALOG)
    ep = Endpoint(replica_id="r0", model="m1", url="http://127.0.0.1:9000", node="n1", draining=True)
    pool.set_endpoints(RoutingEndpoints(version=1, endpoints={"m1": (ep,)}))
    pool.apply_load(_report(r0=(("a1",), {})), 1.0)
    assert "a1" not in pool.ready
    assert "draining" in pool.why_unavailable("a1", 1.0) and "'a1'" in pool.why_unavailable("a1", 1.0)


def test_a_new_table_keeps_what_the_reports_said_and_recomputes_readiness() -> None:
    pool = _pool()
    pool.apply_load(_report(r1=(("a1",), {})), 1.0)
    # r1 leaves the table: a1 is held nowhere now.
    eps = (Endpoint(replica_id="r0", model="m1", url="http://127.0.0.1:9000", node="n1"),)
    pool.set_endpoints(RoutingEndpoints(version=2, endpoints={"m1": eps}))
    assert "a1" not in pool.ready and "m1" in pool.ready
    # A catalog without the adapter: not ready, not known.
    pool.apply_load(_report(r0=(("a1",), {})), 2.0)
    assert "a1" in pool.ready
    pool.set_catalog(Catalog(models=CATALOG.models))
    assert "a1" not in pool.ready and "a1" not in pool.adapters


def test_forget_adapter_drops_one_holder_until_its_next_report() -> None:
    pool = _pool()
    pool.apply_load(_report(r0=(("a1",), {}), r1=(("a1",), {})), 1.0)
    r0 = pool.by_replica["r0"][0]
    pool.forget_adapter(r0, "a1")
    assert _ids(pool.holders("a1")) == ["r1"] and "a1" in pool.ready
    pool.forget_adapter(pool.by_replica["r1"][0], "a1")
    assert "a1" not in pool.ready
    # The next report that lists it again makes r0 a holder again.
    assert pool.apply_load(_report(r0=(("a1",), {}), r1=((), {})), 2.0) is True
    assert _ids(pool.holders("a1")) == ["r0"]


def test_an_adapter_error_names_the_adapter_and_why_unless_a_replica_holds_it() -> None:
    pool = _pool()
    pool.apply_load(_report(r0=((), {"a2": "no adapter weights at /w/a2 on n1"})), 1.0)
    assert pool.adapter_error("a2") == "no adapter weights at /w/a2 on n1"
    why = pool.why_unavailable("a2", 1.0)
    assert "'a2'" in why and "'m1'" in why and "no adapter weights at /w/a2 on n1" in why
    assert prospect(pool, "a2") is Prospect.NOTHING
    # Another replica loaded it after all: it serves, the other's failure is not its.
    pool.apply_load(_report(r1=(("a2",), {})), 2.0)
    assert pool.adapter_error("a2") is None and prospect(pool, "a2") is Prospect.READY
    assert pool.adapter_error("a1") is None and pool.adapter_error("m1") is None


def test_prospect_of_an_adapter_loaded_nowhere_follows_its_base() -> None:
    # Base ready: the adapter is asked for (a wake for the adapter's name).
    pool = _pool()
    assert prospect(pool, "a1") is Prospect.COLD
    assert "not loaded on any ready replica of model 'm1'" in pool.why_unavailable("a1", 0.0)
    # Base cold or coming: asked for too (the control plane wakes the base and loads it).
    assert prospect(_pool(0, cold=("m1",)), "a1") is Prospect.COLD
    assert prospect(_pool(0, coming={"m1": "replica r9 starting"}), "a1") is Prospect.COLD
    # Base with nothing ready or coming: refused at once, with the base's reason under the adapter's name.
    gone = _pool(0, unavailable={"m1": "needs 1 x A100, none free"})
    assert prospect(gone, "a1") is Prospect.NOTHING
    assert gone.why_unavailable("a1", 0.0) == (
        "adapter 'a1': model 'm1' has no ready replica: needs 1 x A100, none free"
    )


def test_pick_for_an_adapter_only_ever_chooses_a_holder_and_none_without_one() -> None:
    pool = _pool(4)
    how = Choosing(load_stale_s=5.0, prefix_load_factor=1.25, rng=random.Random(7))
    assert pick(pool, how, "m1", [], 0.0, adapter="a1") is None
    pool.apply_load(_report(r1=(("a1",), {}), r3=(("a1",), {})), 0.0)
    # Load makes r3 the lighter: P2C over the holders picks it whenever both are drawn.
    pool.by_replica["r1"][0].in_flight = 5
    chosen = {pick(pool, how, "m1", [], 0.0, adapter="a1").replica_id for _ in range(200)}  # type: ignore[union-attr]
    assert chosen == {"r3"}
    # The base's requests still go anywhere.
    pool.by_replica["r1"][0].in_flight = 0
    base = {pick(pool, how, "m1", [], 0.0).replica_id for _ in range(200)}  # type: ignore[union-attr]
    assert base == {"r0", "r1", "r2", "r3"}
    pool.by_replica["r1"][0].in_flight = 5
    # Retries: every holder tried, the choice comes back to a holder, never to r0 or r2.
    r3 = pool.by_replica["r3"][0]
    again = pick(pool, how, "m1", [r3], 0.0, adapter="a1")
    assert again is not None and again.replica_id == "r1"
    last = pick(pool, how, "m1", [r3, pool.by_replica["r1"][0]], 0.0, adapter="a1")
    assert last is not None and last.replica_id in {"r1", "r3"}
