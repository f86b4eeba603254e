"""Pure pieces the operator tests rely on: the status bar and lists, stale refusal reasons."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw_cli.ctl_status import _wrap_ids, render_status, usage_bar
from llmgw_common.catalog import Catalog, ModelProfile
from llmgw_common.ctl import ClassCapacity, StatusReply, UnplaceableInfo
from llmgw_controlplane.scheduler.reconciler import reconcile
from llmgw_controlplane.scheduler.snapshot import GpuView, NodeState, NodeView, Snapshot

pytestmark = pytest.mark.xdist_group("operator")


def cap(total: int, used: int, free: int, unhealthy: int = 0, held: int = 0) -> ClassCapacity:
    return ClassCapacity(gpu_class="H100", total=total, used=used, free=free, unhealthy=unhealthy, held=held)


@pytest.mark.parametrize(
    ("c", "bar"),
    [
        (cap(10, 10, 0), "[" + "#" * 20 + "]"),
        (cap(20, 5, 10, 5), "[#####..........xxxxx]"),
        (cap(8, 0, 0, 0, 8), "[" + "-" * 20 + "]"),
        # One used card in a thousand still shows; one free card in a full class too.
        (cap(1000, 1, 999), "[#" + "." * 19 + "]"),
        (cap(1000, 999, 1), "[" + "#" * 19 + ".]"),
        (cap(0, 0, 0), "[" + " " * 20 + "]"),
    ],
)
def test_usage_bar_shows_every_share_in_proportion(c: ClassCapacity, bar: str) -> None:
    assert usage_bar(c) == bar


def test_usage_bar_rounding_gap_goes_to_the_largest_share() -> None:
    assert usage_bar(cap(6, 1, 0, 1, 4)) == "[###xxx" + "-" * 14 + "]"


def test_wrap_ids_says_how_many_did_not_fit() -> None:
    ids = [f"replica-{i:04d}" for i in range(100)]
    lines = _wrap_ids(ids, max_lines=2, width=60)
    assert len(lines) == 2 and all(len(ln) <= 60 for ln in lines)
    shown = [x.strip(" ,") for ln in lines for x in ln.split(" and ")[0].split(", ")]
    more = int(lines[-1].rsplit(" and ", 1)[1].split()[0])
    assert shown == ids[: len(shown)] and len(shown) + more == 100
    assert _wrap_ids(ids[:2], width=60) == ["  replica-0000, replica-0001"]


def test_status_text_cuts_long_lists_and_lines() -> None:
    s = StatusReply(
        capacity=(cap(8, 1, 7),),
        unplaceable=tuple(UnplaceableInfo(model=f"m{i}", reason="x" * 400) for i in range(9)),
        idle_replicas=tuple(f"r{i:03d}" for i in range(500)),
        idle_threshold_s=3600,
        weights_per_fabric={f"f{i}": tuple(f"w{j}" for j in range(50)) for i in range(10)},
    )
    text = render_status(s)
    lines = text.splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 120, text
    assert "unplaceable: 9 (" in text and "and 3 more (`llmgw ctl models`)" in text
    assert "idle for 1h or more: 500 replica(s)" in text and "and 4 more fabrics" in text


def _node(name: str) -> NodeView:
    return NodeView(
        name=name,
        state=NodeState.READY,
        fabric="ib-a",
        engines=frozenset({"sim"}),
        gpus=tuple(GpuView(i, "H100-80GB", 81559, True, ()) for i in range(2)),
    )


def test_refusal_reasons_are_worked_out_again_when_nodes_join() -> None:
    # Before any node reported, the reason is "no node has reported"; once nodes join (still too small),
    # the next pass must say what they lack, not repeat the empty fleet for reasons_refresh_s.
    profile = ModelProfile(name="m", engine="sim", gpu_class="H100-80GB", gpus_per_node=4, replicas=1)
    empty = Snapshot(now=1000.0, nodes={}, replicas=(), catalog=Catalog(models=(profile,)))
    p1 = reconcile(empty, reasons_refresh_s=60)
    assert "no node has reported" in p1.unplaceable["m"].summary
    joined = replace(empty, now=1001.0, nodes={"a": _node("a"), "b": _node("b")})
    p2 = reconcile(joined, p1.memo, reasons_refresh_s=60)
    assert "no node has reported" not in p2.unplaceable["m"].summary
    assert "needs 4" in p2.unplaceable["m"].summary, p2.unplaceable["m"].summary
    # With the fleet unchanged the reasons are reused (the refresh window still holds).
    p3 = reconcile(replace(joined, now=1002.0), p2.memo, reasons_refresh_s=60)
    assert p3.unplaceable["m"] is p2.unplaceable["m"]
