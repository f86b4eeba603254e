"""Partitions, not only crashes (issue 22): hosts cut apart by DROP rules, joined again, and the promises
checked after each heal.

One topology for the module (:mod:`tests.partition.partition_harness`: eleven namespaces, three
nats-servers at R3, two control planes, two routers, three agents, the notifier), because starting it
costs more than all the cases together; each case heals every rule it made (also when it fails) and
starts by waiting for the cluster to be whole again: both chat replicas served, engines exactly as
assigned. The invariants after each heal:

- client requests failed, for a model with a replica outside the cut: 0, each failure listed;
- no assignment stored under a fence older than one stored before it (the taps' history);
- the engines running are exactly those assigned, as many as wanted, within ``node_lost_s`` of the heal
  (plus JetStream's re-election when a cut nats-server rejoins, ``REJOIN_S``);
- the catalog, the keys and the cluster settings as before;
- ``node.lost`` / ``node.recovered`` delivered to the webhook once per transition, none without one.

The figures (requests, failures, time to converge) are printed with ``-s`` and written to
``test-artifacts/partition.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlError
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_bus import BUS_ERRORS, BusView
from tests.chaos.chaos_traffic import Traffic, wait_serving
from tests.kit.poll import eventually
from tests.partition import netns
from tests.partition.partition_harness import (
    CATALOG,
    CONTROLPLANES,
    HOSTS,
    NATS_HOSTS,
    NODE_LOST_S,
    NODES,
    ROUTERS,
    SETTINGS,
    Hooks,
    NetnsNatsCluster,
    PartitionTopology,
    clients_of,
    connect,
    converged,
    fence_check,
    get_timeouts,
    holder_proc,
    make_taps,
    node_events,
    set_webhook,
    wait_buckets,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("partition")]

# Within this of the heal the cluster must be exactly as wanted again: one node_lost_s (the promise)
# plus the polling's own step.
CONVERGE_S = NODE_LOST_S + 1.0
# When a nats-server cut from its peers rejoins, its RAFT groups come back with higher terms and the
# majority's stream and meta leaders step down ("Detected another leader with higher term, will
# stepdown", then "JetStream cluster no metadata leader"): JetStream writes answer "no response from
# stream" until new leaders are elected, 5-8 s after the heal in the runs measured. That is nats-server's
# own (docs/runbook.md, "A network partition"); after such a heal the promise is CONVERGE_S plus this.
REJOIN_S = 10.0
FIGURES: dict[str, dict[str, Any]] = {}


@dataclass
class Run:
    topo: PartitionTopology
    net: netns.Net
    key: str
    hooks: Hooks
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    why = netns.unsupported_reason()
    if why is not None:
        pytest.skip(f"partition tests need network namespaces: {why}")
    net = netns.Net()
    topo: PartitionTopology | None = None
    hooks: Hooks | None = None
    try:
        for h in HOSTS:
            net.add(h)
        root = Path(tmp_path_factory.mktemp("partition"))
        topo = PartitionTopology(root, prefix="part", settings=dict(SETTINGS), catalog=CATALOG, net=net)
        hooks = Hooks(net.gateway)
        topo.start_nats()
        assert topo.natscluster is not None
        topo.natscluster.wait_meta_leader(timeout=60)
        key = _keys_create(topo, "traffic")
        probe = _keys_create(topo, "probe")
        for cp in CONTROLPLANES:
            topo.start_controlplane(cp)
        wait_buckets(topo)
        asyncio.run(_prepare_bus(topo, hooks.url))
        for r in ROUTERS:
            topo.start_router(r, port=8080)
        for n in NODES:
            topo.start_agent(n)
        topo.start_notifier(probe, router="router-1")
        for r in ROUTERS:
            topo.wait_router(r, timeout=60)
            asyncio.run(wait_serving(topo.router_url(r), key, timeout=90))
        yield Run(topo, net, key, hooks)
    finally:
        if topo is not None:
            topo.stop_quietly()
        if hooks is not None:
            hooks.close()
        net.close()
        out = Path(__file__).resolve().parents[2] / "test-artifacts"
        out.mkdir(exist_ok=True)
        (out / "partition.json").write_text(json.dumps(FIGURES, indent=2))


def _keys_create(topo: PartitionTopology, name: str) -> str:
    r = topo.cli(f"keys-create-{name}", "keys", "create", "--name", name, "-o", "json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["key"])


async def _prepare_bus(topo: PartitionTopology, hook_url: str) -> None:
    nc = await connect(topo)

    async def made() -> bool:
        await make_taps(nc, topo.prefix)
        await set_webhook(nc, topo.prefix, hook_url)
        return True

    try:
        # Right after the buckets are made their streams may still be electing leaders.
        await eventually(
            made, timeout=30, every=0.5, what="the taps and the webhook set", tolerate=BUS_ERRORS
        )
    finally:
        await nc.close()


@dataclass
class Case:
    """One case's view of the cluster: a bus client, traffic through both routers, what it measured."""

    run: Run
    name: str
    nc: NATS
    view: BusView
    desired_before: dict[str, bytes]
    keys_before: set[str]
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    traffic: list[Traffic] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def topo(self) -> PartitionTopology:
        return self.run.topo

    @property
    def net(self) -> netns.Net:
        return self.run.net

    def start_traffic(self, routers: tuple[str, ...] = ROUTERS) -> None:
        for r in routers:
            self.traffic.append(
                Traffic(self.topo.router_url(r), self.run.key, clients=2, timeout_s=20).start()
            )

    async def stop_traffic(self) -> list[str]:
        """Stop the clients; every failed request, explained (empty: none failed)."""
        failed = []
        total = 0
        for t in self.traffic:
            await t.stop()
            total += len(t.records)
            failed += [f"{t.base_url}: +{r.start - self.started:.1f}s {r.why}" for r in t.records if not r.ok]
        self.figures.update(requests=total, failed=len(failed))
        if failed:
            self.figures["failures"] = failed[:5]
        return failed

    async def cut(self, a: str, *others: str) -> float:
        await asyncio.to_thread(self.net.cut, a, *others)
        return time.monotonic()

    async def heal(self) -> float:
        await asyncio.to_thread(self.net.heal)
        return time.monotonic()

    async def endpoint_nodes(self) -> list[str]:
        try:
            return await self.view.endpoint_nodes("chat")
        except BUS_ERRORS:
            return []

    async def check_after_heal(
        self,
        healed: float,
        *,
        transitions: dict[str, list[str]] | None,
        engines: int = 2,
        desired_changes: tuple[str, ...] = (),
        converge_s: float = CONVERGE_S,
    ) -> None:
        """The invariants every case shares, from the moment of the heal. ``desired_changes``: keys of
        the desired state the case itself changed (a drain mark)."""
        took = await converged(self.topo, self.nc, engines, timeout=converge_s + 30)
        self.figures["converge_s"] = round(took, 2)
        assert took <= converge_s, f"{took:.1f}s after the heal the engines were not yet as assigned"
        eps = await eventually(
            lambda: self._endpoints(engines),
            timeout=30,
            every=0.25,
            what=f"{engines} chat endpoints after the heal",
        )
        self.figures["endpoints_after"] = eps
        # ``transitions`` None: the case cannot say beforehand which nodes the control plane will call
        # lost; then what it stored is the reference, and every lost node must have recovered.
        wants: dict[str, list[str]] = {}
        for node in NODES:
            if transitions is not None:
                wants[node] = transitions.get(node, [])
            else:

                async def balanced(node: str = node) -> tuple[list[str]] | None:
                    return await self._balanced(node)

                (wants[node],) = await eventually(
                    balanced,
                    timeout=30,
                    every=0.25,
                    what=f"{node}: every node.lost stored followed by a node.recovered",
                    tolerate=BUS_ERRORS,
                )
        self.figures["transitions"] = {n: w for n, w in wants.items() if w}
        for node, want in wants.items():

            def delivered(node: str = node, want: list[str] = want) -> bool:
                return self.run.hooks.transitions(node, self.started) == want

            try:
                await eventually(
                    delivered, timeout=30, every=0.25, what=f"webhook transitions of {node}: {want}"
                )
            except AssertionError as e:
                raise AssertionError(f"{e}; got {self.run.hooks.transitions(node, self.started)}") from None
        # No late or repeated event: the same, a little later.
        await asyncio.sleep(2)
        for node, want in wants.items():
            got = self.run.hooks.transitions(node, self.started)
            assert got == want, f"{node}: webhook got {got}, want {want}"
            # What the control plane stored is what was delivered: no event lost, none made up.
            stored = await node_events(self.nc, self.topo.prefix, node, self.started_wall)
            assert stored == got, f"{node}: events stream has {stored}, the webhook got {got}"
        self.figures["duplicate_deliveries"] = self.run.hooks.duplicates(self.started)
        # Read through the cluster like any client: right after a cut server rejoins, JetStream may still
        # answer 503 while it re-elects (REJOIN_S).
        fences = await eventually(
            lambda: fence_check(self.nc), timeout=30, every=0.5, what="the taps read", tolerate=BUS_ERRORS
        )
        self.figures["fences"] = fences.line()
        assert not fences.regressions, f"assignments stored under an older fence: {fences.regressions[:5]}"
        desired_now = await eventually(
            self.view.desired_raw, timeout=30, every=0.5, what="the desired state read", tolerate=BUS_ERRORS
        )
        desired = {k: v for k, v in desired_now.items() if k not in desired_changes}
        before = {k: v for k, v in self.desired_before.items() if k not in desired_changes}
        assert desired == before, f"the desired state changed: {sorted(desired)} vs {sorted(before)}"
        keys = await eventually(
            self.view.keys, timeout=30, every=0.5, what="the keys read", tolerate=BUS_ERRORS
        )
        assert set(keys.keys()) >= self.keys_before, "an API key was lost"
        self.figures["after_heal_s"] = round(time.monotonic() - healed, 2)

    async def _balanced(self, node: str) -> tuple[list[str]] | None:
        """The node's stored transitions once they are lost/recovered pairs (in a tuple: an empty
        list is an answer too)."""
        kinds = await node_events(self.nc, self.topo.prefix, node, self.started_wall)
        pairs = kinds == ["node.lost", "node.recovered"] * (len(kinds) // 2)
        return (kinds,) if pairs else None

    async def _endpoints(self, n: int) -> list[str] | None:
        nodes = await self.endpoint_nodes()
        return sorted(nodes) if len(nodes) == n and len(set(nodes)) == n else None

    async def free_node(self) -> str:
        """The node no chat replica is on."""
        nodes = await self.endpoint_nodes()
        (free,) = set(NODES) - set(nodes)
        return free


@pytest.fixture
async def case(run: Run, request: pytest.FixtureRequest) -> AsyncIterator[Case]:
    """A case: starts on a whole cluster, and heals everything it cut whatever happens."""
    nc = await connect(run.topo, f"partition-{request.node.name}"[:60])
    view = BusView(nc, run.topo.prefix)
    c: Case | None = None
    try:
        await converged(run.topo, nc, 2, timeout=60)
        await eventually(
            lambda: _all_nodes_ready(view),
            timeout=30,
            every=0.25,
            what="every node ready in the leader's table",
            tolerate=BUS_ERRORS,
        )
        c = Case(run, request.node.name, nc, view, await view.desired_raw(), set((await view.keys()).keys()))
        yield c
    finally:
        if c is not None:
            for t in c.traffic:
                await t.stop()
            FIGURES[c.name] = c.figures
            print(f"\n{c.name}: {json.dumps(c.figures)}")
        await asyncio.to_thread(run.net.heal)
        await nc.close()


async def _all_nodes_ready(view: BusView) -> bool:
    """The active control plane has every node ready (and answers at all: one leads)."""
    try:
        nodes = await view.ctl.nodes()
    except CtlError:
        return False
    return sorted(n.name for n in nodes.nodes if n.state == "ready") == sorted(NODES)


# ---------------------------------------------------------------- case 1


async def test_agent_cut_from_every_nats_server(case: Case) -> None:
    """(1) An agent partitioned from every NATS server while routers still reach its engines: the node
    is lost and its replica rebuilt elsewhere; clients see nothing; after the heal the agent finds its
    assignment empty and stops the old engine; node.lost and node.recovered once each."""
    before = await case.endpoint_nodes()
    victim = sorted(before)[0]
    case.start_traffic()
    await asyncio.sleep(2)
    cut = await case.cut(victim, *NATS_HOSTS)
    # Lost after node_lost_s of silence, then a replacement on the free node serves.
    eps = await eventually(
        lambda: _two_without(case, victim),
        timeout=NODE_LOST_S + 40,
        every=0.25,
        what=f"chat served by two nodes other than {victim}",
    )
    case.figures["replaced_after_s"] = round(time.monotonic() - cut, 2)
    case.figures["during_cut"] = eps
    assert case.net.dropped(victim) > 0, "the cut dropped nothing: it was no cut"
    # The cut-off agent still runs its engine (nothing told it otherwise): three engines for two wanted,
    # which is what the heal must undo.
    assert len(await asyncio.to_thread(case.topo.engines)) == 3
    await asyncio.sleep(1)
    healed = await case.heal()
    failed = await case.stop_traffic()
    await case.check_after_heal(healed, transitions={victim: ["node.lost", "node.recovered"]})
    assert not failed, f"{len(failed)} client requests failed: {failed[:10]}"


async def _two_without(case: Case, node: str) -> list[str] | None:
    nodes = await case.endpoint_nodes()
    return sorted(nodes) if len(set(nodes)) == 2 and node not in nodes else None


# ---------------------------------------------------------------- case 3


async def test_router_cut_from_nats_while_its_replica_is_drained(case: Case) -> None:
    """(3) A router partitioned from NATS (no table change reaches it) while a replica it routes to is
    drained elsewhere: the drained engine stops; the cut router still sends requests to it, is refused
    before the first byte and retries on the other replica; nothing fails."""
    serving = sorted(await case.endpoint_nodes())
    drained, kept = serving
    free = await case.free_node()
    case.start_traffic()
    await asyncio.sleep(1)
    await case.cut("router-1", *NATS_HOSTS)
    await asyncio.sleep(3)  # its bus connection is gone (pings every 2 s): it routes from what it holds
    try:
        await case.view.ctl.drain(drained, grace_s=30)
        # The replacement serves on the free node, then the drained engine stops.
        await eventually(
            lambda: _serving_on(case, {kept, free}),
            timeout=40,
            every=0.25,
            what=f"chat served on {kept} and {free} only, no engine on {drained}",
        )
        drained_at = time.monotonic()
        await asyncio.sleep(4)  # router-1 keeps its stale table: requests meet the stopped engine
        case.figures["cut_router_requests_after_drain"] = sum(
            1 for r in case.traffic[0].records if r.start >= drained_at
        )
        assert case.net.dropped("router-1") > 0
        healed = await case.heal()
        await asyncio.sleep(2)
        failed = await case.stop_traffic()
    finally:
        await case.view.ctl.uncordon(drained)
    await case.check_after_heal(healed, transitions={}, desired_changes=("marks",))
    assert not failed, f"{len(failed)} client requests failed: {failed[:10]}"


async def _serving_on(case: Case, nodes: set[str]) -> bool:
    eps = await case.endpoint_nodes()
    running = {h for h, _ in await asyncio.to_thread(case.topo.engines)}
    return set(eps) == nodes and len(eps) == len(nodes) and running == nodes


# ---------------------------------------------------------------- case 2


async def test_leader_cut_from_two_of_three_servers(case: Case) -> None:
    """(2) The leading control plane partitioned from two of the three NATS servers, the one it is
    connected to among them: it reconnects to the third or is deposed; either way one leader at a
    time, no fence reused or regressed, nothing replaced, nothing failed."""
    lease, _rev = await case.view.lease()
    assert lease is not None
    leader = holder_proc(case.topo, lease.holder)
    assert leader is not None, f"no control plane of ours holds the lease ({lease.holder})"
    conns = clients_of(case.topo)
    on = [s for s in NATS_HOSTS if leader in conns[s]]
    assert on, f"{leader} is connected to no server: {conns}"
    others = [s for s in NATS_HOSTS if s != on[0]]
    cut_from = [on[0], others[0]]
    case.figures.update(leader=leader, connected_to=on[0], cut_from=cut_from)
    engines_before = await asyncio.to_thread(case.topo.engines)
    case.start_traffic()
    await asyncio.sleep(1)
    cut = await case.cut(leader, *cut_from)
    # Two lease TTLs: long enough for a standby to take over if the leader could not renew.
    await asyncio.sleep(2 * float(SETTINGS["LLMGW_LEASE_TTL_S"]))
    assert case.net.dropped(leader) > 0
    lease_now, _ = await case.view.lease()
    assert lease_now is not None
    case.figures["leader_during_cut"] = holder_proc(case.topo, lease_now.holder)
    case.figures["cut_s"] = round(time.monotonic() - cut, 1)
    # Nothing was rebuilt while the leader moved (or did not): the same engines.
    assert await asyncio.to_thread(case.topo.engines) == engines_before
    healed = await case.heal()
    await asyncio.sleep(2)
    failed = await case.stop_traffic()
    await case.check_after_heal(healed, transitions={})
    assert await asyncio.to_thread(case.topo.engines) == engines_before, "an engine was replaced"
    assert not failed, f"{len(failed)} client requests failed: {failed[:10]}"


# ---------------------------------------------------------------- case 2, a finding


async def test_node_recovers_while_the_leadership_changes_hands(case: Case) -> None:
    """(2') Cases 1 and 2 at once: a node is lost (the leader says so), then the leader is cut from
    every NATS server and the node comes back before the standby takes over: the webhook must still
    get node.lost and then node.recovered, once each. (It got node.lost only while node events came
    from each process's own transitions: the standby judged the recovery and dropped it. Now the new
    leader compares the announced state in ``<prefix>_announced`` with its own, see announcements.py.)"""
    victim = await case.free_node()
    lease, _ = await case.view.lease()
    assert lease is not None
    leader = holder_proc(case.topo, lease.holder)
    assert leader is not None
    case.figures.update(leader=leader, node=victim)
    await case.cut(victim, *NATS_HOSTS)
    await eventually(
        lambda: _stored(case, victim, "node.lost"),
        timeout=NODE_LOST_S + 20,
        every=0.25,
        what=f"node.lost for {victim} stored",
        tolerate=BUS_ERRORS,
    )
    await case.cut(leader, *NATS_HOSTS)
    await asyncio.sleep(1)
    # The node is back while the old leader is cut off and the standby is not leading yet.
    await asyncio.to_thread(case.net.heal, victim)
    await asyncio.sleep(3 * float(SETTINGS["LLMGW_LEASE_TTL_S"]))
    lease_now, _ = await case.view.lease()
    assert lease_now is not None
    case.figures["leader_after"] = holder_proc(case.topo, lease_now.holder)
    healed = await case.heal()
    await case.check_after_heal(healed, transitions={victim: ["node.lost", "node.recovered"]})


# ---------------------------------------------------------------- case 6


async def test_notifier_cut_off_while_a_node_is_lost_twice(case: Case) -> None:
    """(6) The notifier cut off from NATS while a node is lost, recovers, is lost and recovers again
    (its link set down, then up): after the notifier's heal the webhook gets the four transitions,
    in order, once each."""
    victim = await case.free_node()
    await case.cut("notifier", *NATS_HOSTS)
    await asyncio.sleep(1)
    for _ in range(2):
        await asyncio.to_thread(case.net.link, victim, up=False)
        await eventually(
            lambda: _stored(case, victim, "node.lost"),
            timeout=NODE_LOST_S + 20,
            every=0.25,
            what=f"node.lost for {victim} stored",
            tolerate=BUS_ERRORS,
        )
        await asyncio.to_thread(case.net.link, victim, up=True)
        await eventually(
            lambda: _stored(case, victim, "node.recovered"),
            timeout=20,
            every=0.25,
            what=f"node.recovered for {victim} stored",
            tolerate=BUS_ERRORS,
        )
    # Cut off all along: nothing reached the webhook yet.
    assert case.run.hooks.transitions(victim, case.started) == []
    assert case.net.dropped("notifier") > 0
    healed = await case.heal()
    delivered = await eventually(
        lambda: len(case.run.hooks.transitions(victim, case.started)) == 4 or None,
        timeout=40,
        every=0.25,
        what="four transitions delivered after the notifier's heal",
    )
    assert delivered
    case.figures["delivered_after_heal_s"] = round(time.monotonic() - healed, 2)
    await case.check_after_heal(healed, transitions={victim: ["node.lost", "node.recovered"] * 2})


async def _stored(case: Case, node: str, kind: str) -> bool:
    kinds = await node_events(case.nc, case.topo.prefix, node, case.started_wall)
    return bool(kinds) and kinds[-1] == kind


# ---------------------------------------------------------------- case 4


GROWN = CATALOG.replace("replicas: 2", "replicas: 3")


async def test_one_server_cut_from_the_other_two(case: Case) -> None:
    """(4) A nats-server that no control plane is connected to, partitioned from the other two (its
    clients still reach it), under traffic and a catalog change (chat from 2 replicas to 3): the change
    is taken during the cut; after the heal three engines serve, each assigned; agents whose heartbeats
    were stuck on the island may have been lost, and then each transition is delivered once."""
    conns = clients_of(case.topo)
    spare = [s for s in NATS_HOSTS if not set(CONTROLPLANES) & set(conns[s])]
    isolated = max(spare, key=lambda s: len([h for h in conns[s] if h != "test"]))
    await _one_server_cut(case, isolated, conns)


async def test_the_leaders_server_cut_from_the_other_two(case: Case) -> None:
    """(4b) The nats-server the leading control plane is connected to, partitioned from the other two:
    the leader cannot renew and stops acting; a control plane must take the catalog change during the
    cut (the standby, or the leader on another server) and all else as in (4).

    Its three findings, each fixed: with both control planes on the cut server none led until the heal
    (its server answers pings, only JetStream says 503: a lease unanswered for a TTL now moves the
    control plane to another server, leadership.leave_if_stranded); takeover reads from the majority
    still went to the cut server's copy until its route was noticed dead, 2 min x 2 by default
    (deploy/nats: route pings every 2 s, 3 missed); node events judged during the handover were
    dropped (case 2')."""
    lease, _ = await case.view.lease()
    assert lease is not None
    leader = holder_proc(case.topo, lease.holder)
    conns = clients_of(case.topo)
    (isolated,) = [s for s in NATS_HOSTS if leader in conns[s]]
    case.figures["leader"] = leader
    await _one_server_cut(case, isolated, conns)


async def _one_server_cut(case: Case, isolated: str, conns: dict[str, list[str]]) -> None:
    majority = [s for s in NATS_HOSTS if s != isolated]
    case.figures.update(isolated=isolated, its_clients=[h for h in conns[isolated] if h != "test"])
    # Every node a client of the cut server (1 run in 27: clients pick servers at random): from the
    # majority's side no node reports, every replica is withdrawn with nowhere to go, and new requests
    # are refused 503 until the heal (docs/runbook.md, "A network partition", what it cannot). Streams
    # in flight still finish (the router gives a withdrawn engine up only once it is silent).
    all_cut = set(NODES) <= set(conns[isolated])
    case.figures["all_nodes_cut"] = all_cut
    case.start_traffic()
    await asyncio.sleep(1)
    cut = await case.cut(isolated, *majority)
    await asyncio.sleep(3)
    refused = ""
    try:
        # Right after the cut the streams led from the cut server are electing new leaders (gets
        # through a leader time out too); later only the direct gets still meet the cut copy.
        case.figures["get_timeouts_early"] = await get_timeouts(case.topo, majority)
        try:
            # An operator on the majority's side: a client of the cut server is on an island too.
            case.figures["applied_during_cut"] = await _apply(case, GROWN, majority, timeout=20)
        except AssertionError as e:
            refused = str(e)  # asserted after the heal: the cluster must be joined again first
        await asyncio.sleep(max(0.0, cut + NODE_LOST_S + 3 - time.monotonic()))
        case.figures["get_timeouts_late"] = await get_timeouts(case.topo, majority)
        assert case.net.dropped(isolated) > 0
        healed = await case.heal()
        case.figures["cut_s"] = round(healed - cut, 1)
        if refused:
            case.figures["applied_after_heal"] = await _apply(case, GROWN, timeout=60)
        await asyncio.sleep(2)
        failed = await case.stop_traffic()
        if all_cut:
            refused_503 = [f for f in failed if "HTTP 503" in f and "has no ready replica" in f]
            case.figures["refused_while_all_nodes_cut"] = len(refused_503)
            failed = [f for f in failed if f not in refused_503]
        await case.check_after_heal(
            healed,
            transitions=None,
            engines=3,
            desired_changes=("catalog",),
            converge_s=CONVERGE_S + REJOIN_S,
        )
    finally:
        await asyncio.to_thread(case.net.heal)
        await _apply(case, CATALOG, timeout=60)
        await converged(case.topo, case.nc, 2, timeout=60)
    assert not refused, f"no control plane took the catalog change while {isolated} was cut off: {refused}"
    assert not failed, f"{len(failed)} client requests failed: {failed[:10]}"


async def _apply(case: Case, catalog: str, servers: list[str] | None = None, timeout: float = 40) -> str:
    """Apply ``catalog`` as an operator connected to ``servers`` (default: any), retrying while no
    control plane answers (a takeover under way); how long it took."""
    t0 = time.monotonic()
    nc = case.nc
    if servers is not None:
        assert isinstance(case.topo.natscluster, NetnsNatsCluster)
        urls = [case.topo.natscluster.urls[NATS_HOSTS.index(s)] for s in servers]
        nc = await bus.connect(
            BusSettings(nats_urls=urls, prefix=case.topo.prefix, kv_replicas=3), "partition-operator"
        )
    try:
        ctl = CtlClient(nc, case.topo.prefix, timeout=2.0)
        await eventually(
            lambda: ctl.catalog_apply(catalog),
            timeout=timeout,
            every=0.5,
            what="the catalog applied",
            tolerate=BUS_ERRORS,
        )
    finally:
        if nc is not case.nc:
            await nc.close()
    return f"{time.monotonic() - t0:.1f}s"


# ---------------------------------------------------------------- case 5

# A minute, as issue 22 asks (30 s more than before, out of the module's ~5 min).
FLAP_CUT_S, FLAP_HEAL_S, FLAP_FOR_S = 2.0, 3.0, 60.0


async def test_flapping_link_between_an_agent_and_nats(case: Case) -> None:
    """(5) A link that flaps (cut 2 s, healed 3 s, for 60 s) between a serving agent and every NATS
    server: each silence is shorter than node_lost_s, so no node.lost, nothing replaced, no churn."""
    victim = sorted(await case.endpoint_nodes())[0]
    engines_before = await asyncio.to_thread(case.topo.engines)
    case.start_traffic()
    t_end = time.monotonic() + FLAP_FOR_S
    flaps = 0
    while time.monotonic() < t_end:
        await case.cut(victim, *NATS_HOSTS)
        await asyncio.sleep(FLAP_CUT_S)
        await case.heal()
        flaps += 1
        await asyncio.sleep(FLAP_HEAL_S)
    healed = time.monotonic()
    case.figures["flaps"] = flaps
    await asyncio.sleep(2)
    failed = await case.stop_traffic()
    await case.check_after_heal(healed, transitions={})
    assert await asyncio.to_thread(case.topo.engines) == engines_before, "an engine was replaced"
    assert not failed, f"{len(failed)} client requests failed: {failed[:10]}"
