"""What operators see of LoRA adapters (issue 33): `ctl models`, `ctl explain-placement ADAPTER`,
`ctl replicas --failed` and the console's Models page, from real replies built over a snapshot."""

from __future__ import annotations

from dataclasses import replace

from llmgw_cli.ctl_failures import render_failed
from llmgw_cli.ctl_render import render_models, render_replicas
from llmgw_common.catalog import AdapterProfile, Catalog
from llmgw_common.ctl import ModelsReply, ReplicaInfo, ReplicaPhase, ReplicasReply
from llmgw_common.messages import LoadReport, ReplicaLoad, ReplicaSpec
from llmgw_controlplane.adapter_views import adapter_explain, adapters_info, with_adapters
from llmgw_controlplane.scheduler.adapter_book import AdapterBook
from llmgw_controlplane.scheduler.adapter_reports import AdapterReports
from llmgw_controlplane.scheduler.demand import Merged
from llmgw_controlplane.scheduler.snapshot import Snapshot
from tests.console.console_fleet import FixedSource
from tests.console.console_pages import client, get, rows
from tests.placement.placement_kit import node, profile, replica, snap

BASE = profile("base", engine="sim", max_loras=2)
ADAPTERS = (
    AdapterProfile(name="sql", base="base", weights="w-sql"),
    AdapterProfile(name="chat", base="base", weights="w-chat", rank=8),
    AdapterProfile(name="broken", base="base", weights="w-broken"),
    AdapterProfile(name="cold", base="base", weights="w-cold"),
)
ERR = "no adapter weights at w-broken on this node"


def _world() -> tuple[Snapshot, AdapterBook]:
    reps = [
        replica(rid, "base", [(n, ())], spec=ReplicaSpec.of(BASE)) for rid, n in (("r1", "n1"), ("r2", "n2"))
    ]
    s = snap([node("n1", 0), node("n2", 0)], reps, [BASE], now=1000.0)
    s = replace(s, catalog=Catalog(models=s.catalog.models, adapters=ADAPTERS))
    book = AdapterBook(AdapterReports(stale_s=10.0))
    for n, rid in (("n1", "r1"), ("n2", "r2")):
        line = ReplicaLoad(
            replica_id=rid, adapters=("sql",) if rid == "r1" else (), adapter_errors={"broken": ERR}
        )
        book.reports.add(LoadReport(node=n, sent_at=0.0, replicas=(line,)), 999.0)
    book.ask("chat", 999.0)
    book.decide(s, {"sql": _merged(3)}, lambda: {"r1": ("sql",)})
    return s, book


def _merged(n: int) -> Merged:
    return Merged(1, n, 0, 0, 0, None, None, None, None, 0, 30.0)


def test_ctl_models_lists_each_adapter_where_it_is_and_why_not() -> None:
    s, book = _world()
    info = {a.name: a for a in adapters_info(s, book, {"sql": 3})}
    assert (info["sql"].state, info["sql"].loaded_on, info["sql"].requests) == ("loaded", ("r1",), 3)
    assert (info["chat"].state, info["chat"].assigned_to, info["chat"].loads) == ("loading", ("r2",), 1)
    assert info["broken"].state == "failed" and ERR in (info["broken"].reason or "")
    assert info["broken"].errors == {"r1": ERR, "r2": ERR}
    assert (info["cold"].state, info["cold"].loaded_on) == ("idle", ())
    out = render_models(ModelsReply(adapters=tuple(info.values())))
    assert "ADAPTER" in out and "LOADS/UNLOADS" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert lines["sql"].split()[:4] == ["sql", "base", "loaded", "r1"]
    assert "asked of r2" in lines["chat"] and "0/0" not in lines["chat"]
    assert ERR in lines["broken"]


def test_explain_placement_of_an_adapter_says_per_replica_why() -> None:
    s, book = _world()
    sql = adapter_explain(s, book, ADAPTERS[0])
    assert sql.placeable and sql.summary == "adapter sql of base is loaded and served"
    broken = adapter_explain(s, book, ADAPTERS[2])
    assert not broken.placeable
    assert broken.summary == "adapter broken of base cannot be loaded on any replica of its base"
    assert [v.reasons[0] for v in broken.nodes] == [f"its load failed: {ERR}"] * 2
    cold = adapter_explain(s, book, ADAPTERS[3])
    assert (
        cold.placeable and "r1" in cold.nodes[0].node and cold.nodes[0].reasons == ("holds 1 of 2 adapters",)
    )
    nobody = adapter_explain(replace(s, replicas=()), book, ADAPTERS[3])
    assert not nobody.placeable and "no replica of base runs; a request wakes it" in nobody.summary


def test_ctl_replicas_failed_shows_adapter_load_errors() -> None:
    s, book = _world()
    rows_ = tuple(
        ReplicaInfo(id=r.id, model="base", state=ReplicaPhase.READY, created=0.0) for r in s.replicas
    )
    reply = ReplicasReply(replicas=with_adapters(rows_, s, book))
    assert reply.replicas[0].adapters == ("sql",)
    out = render_failed(reply, 1000.0)
    assert "no failed replica kept" in out
    assert f"r1 (base) adapter broken: {ERR}" in out and f"r2 (base) adapter broken: {ERR}" in out
    assert f"r2 adapter broken: {ERR}" in render_replicas(reply)
    # Nothing failed anywhere: no adapter section.
    assert "adapter" not in render_failed(ReplicasReply(replicas=rows_), 1000.0)


async def test_the_console_models_page_lists_adapters() -> None:
    s, book = _world()
    src = FixedSource(models_reply=ModelsReply(adapters=adapters_info(s, book, {"sql": 3})))
    async with client(src) as c:
        page = await get(c, "/models")
    got = rows(page, "adapters")
    assert got[0].startswith("adapter base state loaded on")
    assert "sql base loaded r1 3 0 0" in got
    assert any(r.startswith("broken base failed -") and ERR in r for r in got)
    empty = FixedSource(models_reply=ModelsReply())
    async with client(empty) as c:
        assert 'id="adapters"' not in await get(c, "/models")


def test_a_catalog_diff_lists_adapters_added_removed_and_changed() -> None:
    from llmgw_controlplane.views import catalog_diff

    old = Catalog(models=(BASE,), adapters=ADAPTERS[:2])
    new = Catalog(
        models=(BASE,), adapters=(ADAPTERS[0], ADAPTERS[1].model_copy(update={"rank": 16}), ADAPTERS[3])
    )
    d = catalog_diff(old, new)
    assert (d.added, d.removed) == (("adapter cold",), ())
    assert [(c.name, [(f.field, f.old, f.new) for f in c.changes]) for c in d.changed] == [
        ("adapter chat", [("rank", "8", "16")])
    ]
    assert catalog_diff(new, old).removed == ("adapter cold",)
