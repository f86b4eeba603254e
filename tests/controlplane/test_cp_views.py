"""The ctl views from one source: per-node GPU figures that the status totals are the sums of, and
simulated nodes said as such. Pure: a ClusterState fed real messages at injected times."""

from __future__ import annotations

from collections import Counter

from llmgw_cli.ctl_render import render_nodes
from llmgw_cli.ctl_status import render_status
from llmgw_common.codec import decode, encode
from llmgw_common.ctl import NodesReply, StatusReply
from llmgw_common.messages import (
    ClusterSettings,
    GpuInfo,
    Heartbeat,
    Inventory,
    Marks,
    ReplicaRecord,
    ShardPlacement,
)
from llmgw_controlplane import views
from llmgw_controlplane.scheduler.idle import IdleMerger
from llmgw_controlplane.state import ClusterState

T0 = 1000.0


def _inv(node: str, gpus: int = 4, unhealthy: tuple[int, ...] = (), simulated: bool = False) -> Inventory:
    return Inventory(
        node=node,
        boot_id="b1",
        sent_at=0.0,
        fabric="f1",
        simulated=simulated,
        gpus=tuple(
            GpuInfo(
                index=i,
                uuid=f"{node}-{i}",
                name="H",
                gpu_class="H100",
                memory_mb=1,
                healthy=i not in unhealthy,
            )
            for i in range(gpus)
        ),
    )


def _fleet(simulated: frozenset[str] = frozenset()) -> tuple[ClusterState, float]:
    """ready, cordoned, draining and lost nodes, each with one replica on GPU 0 and one unhealthy card."""
    st = ClusterState(heartbeat_interval_s=2.0, unreachable_after_missed=3, node_lost_s=30.0)
    names = ("ready", "cordoned", "draining", "lost")
    for n in names:
        st.on_inventory(_inv(n, unhealthy=(3,), simulated=n in simulated), now=T0)
        st.put_replica(
            ReplicaRecord(
                id=f"r-{n}",
                model="m",
                created=T0,
                shards=(ShardPlacement(shard=0, node=n, gpus=(0,), port=1),),
            )
        )
    now = T0 + 40.0  # past node_lost_s for the one that stays silent
    for n in names[:3]:
        st.on_heartbeat(Heartbeat(node=n, boot_id="b1", seq=1, sent_at=0.0), now=now)
    st.marks = Marks(cordoned=("cordoned",), draining={"draining": now + 600})
    return st, now


def _status(st: ClusterState, now: float) -> StatusReply:
    snap = st.snapshot(now)
    return views.status_info(
        st,
        snap,
        IdleMerger(stale_s=5.0),
        models=(),
        unplaceable={},
        unplaceable_since={},
        settings=ClusterSettings(),
        idle_threshold_s=3600.0,
        leader=True,
        fence=1,
        catalog_version=1,
    )


def test_nodes_free_and_status_free_held_come_from_one_count() -> None:
    st, now = _fleet()
    nodes = {n.name: n for n in views.nodes_info(st, st.snapshot(now))}
    assert nodes["lost"].state == "lost"
    # Only the ready node has free cards; the others' idle healthy cards are held, not free.
    figures = {
        n: (x.gpus_used, x.gpus_free, x.gpus_held, x.gpus_unhealthy, x.gpus_total) for n, x in nodes.items()
    }
    assert figures == {
        "ready": (1, 2, 0, 1, 4),
        "cordoned": (1, 0, 2, 1, 4),
        "draining": (1, 0, 2, 1, 4),
        "lost": (1, 0, 2, 1, 4),
    }
    (cap,) = _status(st, now).capacity
    sums: Counter[str] = Counter()
    for x in nodes.values():
        sums.update(
            total=x.gpus_total,
            used=x.gpus_used,
            free=x.gpus_free,
            held=x.gpus_held,
            unhealthy=x.gpus_unhealthy,
        )
    assert (cap.total, cap.used, cap.free, cap.held, cap.unhealthy) == (
        sums["total"],
        sums["used"],
        sums["free"],
        sums["held"],
        sums["unhealthy"],
    )
    assert cap.total == cap.used + cap.free + cap.held + cap.unhealthy
    # The rendered FREE figure is the JSON's.
    text = render_nodes(NodesReply(nodes=tuple(nodes.values())))
    row = next(ln for ln in text.splitlines() if ln.startswith("cordoned"))
    assert "1/0/2/4" in row, text


def test_free_whole_nodes_use_the_same_count() -> None:
    st, now = _fleet()
    st.drop_replica("r-ready")
    assert _status(st, now).free_nodes_per_fabric == {"f1": 1}


def test_simulated_nodes_are_marked_in_nodes_and_status() -> None:
    st, now = _fleet(simulated=frozenset({"ready", "lost"}))
    reply = NodesReply(nodes=views.nodes_info(st, st.snapshot(now)))
    assert {n.name for n in reply.nodes if n.simulated} == {"ready", "lost"}
    text = render_nodes(reply)
    marks = {ln.split()[0]: ln for ln in text.splitlines()[1:5]}
    assert "SIM" in marks["ready"] and "SIM" in marks["lost"] and "SIM" not in marks["cordoned"], text
    assert "SIM: simulated node" in text
    s = _status(st, now)
    assert s.simulated_nodes == 2
    assert "2 simulated nodes: capacity shown is not real" in s.warnings
    assert "warning: 2 simulated nodes: capacity shown is not real" in render_status(s).splitlines()


def test_real_fleet_has_no_sim_marker_or_warning() -> None:
    st, now = _fleet()
    text = render_nodes(NodesReply(nodes=views.nodes_info(st, st.snapshot(now))))
    assert "SIM" not in text
    s = _status(st, now)
    assert s.simulated_nodes == 0 and not any("simulated" in w for w in s.warnings)


def test_inventory_without_the_simulated_field_decodes_as_real() -> None:
    import msgpack

    raw = msgpack.unpackb(encode(_inv("old", simulated=True)))
    del raw["simulated"]  # what an agent built before the field existed sends
    inv = decode(msgpack.packb(raw), Inventory)
    assert inv.simulated is False
    assert decode(encode(_inv("new", simulated=True)), Inventory).simulated is True
