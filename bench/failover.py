"""How long failures take to heal: a lost node's replica serving again, and a standby taking over.

Boots a cluster of real processes (the chaos suite's harness, ``tests/chaos/chaos_harness.py``): a
nats-server, two control planes (one leads, one stands by), a router, three agents with simulated
8xH100 nodes, and a catalog whose model ``chat`` has two replicas. Then, under sixteen clients streaming
200-token answers (each checked against the uninterrupted answer: text, one finish, one [DONE], usage):

1. **node loss**: SIGKILL the agent and the engines of a node hosting ``chat``; seconds until the
   routing endpoints list two replicas again, none on the dead node (an endpoint is listed only once its
   engine is ready, so this is "replacement serving");
2. **standby takeover**: SIGKILL the leading control plane; seconds until the standby has made its first
   reconcile pass (it answers ``debug.stats`` as leader, with a new fence, and passes > 0).

Both are measured with the defaults (heartbeat 2 s, node lost after 30 s, lease TTL 10 s, tick 1 s)
and with aggressive settings (heartbeat 0.5 s, lost after 4 s, lease 3 s, tick 0.25 s). Failed requests
are counted, those in flight at the kill and those started after it, and so is the pause the streams
cut by the kill saw: the router continues each on the other replica (mid-stream failover), and the gap
between the last event before the cut and the first after it is the largest of such a stream's gaps.
The streams migrated are counted from the router's log; their gaps are the that many largest among the
streams in flight at the kill (p50/p99/max), beside the largest gap of the streams that were not moved.

    .venv/bin/python bench/failover.py            # aggressive x3, defaults x1: about 2 minutes
    .venv/bin/python bench/failover.py --quick    # one of each: about 1.5 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "chaos"))

from chaos_bus import BusView, timed  # noqa: E402
from chaos_harness import AGGRESSIVE, ChaosCluster, boot  # noqa: E402
from chaos_traffic import Traffic, streams_on  # noqa: E402

from llmgw_common.ctl import DebugStatsReply  # noqa: E402

DEFAULTS = {"LLMGW_STOP_GRACE_S": "2"}  # every timeout at its default; engines stop quickly at the end


@dataclass
class Trial:
    setting: str
    node_loss_s: float
    takeover_s: float
    requests: int
    failed_after_kill: int
    in_flight: int
    in_flight_failed: int
    migrated: int
    gap_p50_ms: float
    gap_p99_ms: float
    gap_max_ms: float
    # The largest gap of the streams in flight at the kill that were not migrated.
    other_gap_max_ms: float


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


async def _leader_pass(view: BusView, old_fence: int) -> DebugStatsReply | None:
    st = await view.stats()
    return st if st is not None and st.leader and st.fence != old_fence and st.passes > 0 else None


async def _measure(c: ChaosCluster, key: str, setting: str, lost_s: float, lease_s: float) -> Trial:
    view = await BusView.connect(c.nats_url, c.prefix)
    traffic = Traffic(c.router_url(), key, clients=16, max_tokens=200, verify=True)
    try:

        async def two_hosts() -> set[str] | None:
            hosts = view.nodes_hosting("chat")
            return hosts if len(hosts) == 2 and len(view.engine_pids()) == 2 else None

        hosts, _ = await timed("two nodes host chat", two_hosts, 30)
        victim = sorted(hosts)[0]
        engines = sorted(set(view.engine_pids(victim).values()))
        traffic.start()

        async def victim_busy() -> float | None:
            # Kill once the victim streams: the router may have sent it nothing for a while.
            if sum(1 for r in traffic.records if r.ok) < 16:
                return None
            running = await streams_on(view, "chat", victim)
            return running if running >= 4 else None

        await timed("the victim streaming", victim_busy, 60, every=0.05)
        # 1. node loss
        t_kill = time.monotonic()
        c.procs[f"agent-{victim}"].signal(signal.SIGKILL)
        for pid in engines:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        c.procs[f"agent-{victim}"].kill()

        async def rebuilt() -> list[str] | None:
            nodes = await view.endpoint_nodes("chat")
            return nodes if len(nodes) == 2 and victim not in nodes else None

        _, node_loss_s = await timed("replacement serving", rebuilt, lost_s + 60, every=0.05)
        # 2. standby takeover
        old = await view.stats()
        assert old is not None
        lease, _ = await view.lease()
        assert lease is not None
        active = next(
            p for p in c.procs.values()
            if p.name.startswith("cp-") and p.alive() and lease.holder == f"{socket.gethostname()}-{p.pid}"
        )  # fmt: skip
        active.kill()
        _, takeover_s = await timed(
            "standby's first pass", lambda: _leader_pass(view, old.fence), 4 * lease_s + 20, 0.05
        )
        await asyncio.sleep(1.0)
        await traffic.stop()
        after = traffic.started_after(t_kill)
        flying = traffic.in_flight_at(t_kill)
        migrated = c.procs["router"].log_path.read_text(errors="replace").count("continuing on")
        gaps = sorted((r.gap for r in flying.records), reverse=True)
        moved, others = gaps[:migrated], gaps[migrated:]
        print(
            f"  {setting}: node loss -> replacement serving {node_loss_s:.1f}s; standby's first pass "
            f"{takeover_s:.2f}s after SIGKILL of the leader; {traffic.all().line()}; "
            f"{after.line()}; in flight at the kill: {len(flying.records)}, {len(flying.failed)} failed, "
            f"{migrated} continued on the other replica; stream gap at the migration p50 "
            f"{_pct(moved, 0.5) * 1000:.0f} ms p99 {_pct(moved, 0.99) * 1000:.0f} ms (largest gap of the "
            f"others {max(others, default=0) * 1000:.0f} ms)",
            flush=True,
        )
        return Trial(
            setting, round(node_loss_s, 2), round(takeover_s, 2), len(traffic.records),
            len(after.failed), len(flying.records), len(flying.failed), migrated,
            round(_pct(moved, 0.5) * 1000, 1), round(_pct(moved, 0.99) * 1000, 1),
            round(max(moved, default=0) * 1000, 1), round(max(others, default=0) * 1000, 1),
        )  # fmt: skip
    finally:
        await traffic.stop()
        await view.close()


def run_setting(setting: str, env: dict[str, str], runs: int, root: Path) -> list[Trial]:
    lost_s = float(env.get("LLMGW_NODE_LOST_S", 30))
    lease_s = float(env.get("LLMGW_LEASE_TTL_S", 10))
    trials = []
    for i in range(runs):
        t0 = time.monotonic()
        c, key = boot(
            root / f"{setting}-{i}",
            nodes=("n1", "n2", "n3"),
            controlplanes=("cp-a", "cp-b"),
            settings=env,
            timeout=120,
        )
        try:
            print(f"  {setting} #{i + 1}: cluster up in {time.monotonic() - t0:.1f}s", flush=True)
            trials.append(asyncio.run(_measure(c, key, setting, lost_s, lease_s)))
        finally:
            c.close()
    return trials


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one trial per setting")
    ap.add_argument("--runs", type=int, default=3, help="trials with aggressive settings (default 3)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    # The harness's own clients log their disconnect on close: noise here.
    logging.getLogger("llmgw.bus").setLevel(logging.ERROR)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as tmp:
        print("aggressive:", " ".join(f"{k}={v}" for k, v in AGGRESSIVE.items()), flush=True)
        aggressive = run_setting("aggressive", dict(AGGRESSIVE), runs, Path(tmp))
        print("defaults: heartbeat 2 s, node lost 30 s, lease TTL 10 s, settle 6 s, tick 1 s", flush=True)
        default = run_setting("defaults", dict(DEFAULTS), 1, Path(tmp))
    rows = [*default, *aggressive]
    print()
    print(
        f"{'setting':<11} {'node loss -> serving (s)':>25} {'standby takeover (s)':>21} {'failed after kill':>18}"
        f" {'in flight: failed/all':>22} {'migrated':>9} {'gap p50/p99/max (ms)':>21} {'others max':>11}"
    )
    for t in rows:
        print(
            f"{t.setting:<11} {t.node_loss_s:>25.1f} {t.takeover_s:>21.2f} {t.failed_after_kill:>18}"
            f" {f'{t.in_flight_failed}/{t.in_flight}':>22} {t.migrated:>9}"
            f" {f'{t.gap_p50_ms:.0f}/{t.gap_p99_ms:.0f}/{t.gap_max_ms:.0f}':>21} {t.other_gap_max_ms:>11.0f}"
        )
    print(f"total {time.monotonic() - t0:.0f}s")
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in rows], indent=1))


if __name__ == "__main__":
    main()
