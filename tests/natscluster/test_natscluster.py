"""The llmgw services on a three-server NATS cluster (R3 buckets, per-role users); one server SIGKILLed.

One topology for the module: three nats-servers configured as ``deploy/nats/nats-{1,2,3}.conf`` says
(loopback ports, the generated per-role authorization included), a control plane, a router, a
notifier and two agents with simulated GPUs, each process holding all three URLs and its own role's
credentials. The first test kills the JetStream meta leader under traffic and shows that serving,
placement (a catalog change) and ``llmgw ctl`` keep working. The last test closes the topology and
greps every log the run wrote for every secret it handled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_bus import BUS_ERRORS, timed
from tests.chaos.chaos_harness import AGGRESSIVE
from tests.chaos.chaos_traffic import Traffic, wait_serving
from tests.kit.poll import eventually
from tests.natscluster.natscluster_harness import Topology, service_logs

pytestmark = [pytest.mark.xdist_group("natscluster"), pytest.mark.e2e, pytest.mark.slow]

NODES = ("n1", "n2")
# A watched model (the notifier probes it through the router with its probe key) and a model no node
# can hold (A100s: none here), so that a placement.failing event reaches the webhooks early.
CATALOG = """\
models:
  - name: chat
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 2
    startup_timeout_s: 30
    watch: {probe_every: 2s, budget: 1s}
    options: {startup_s: 0.3, ttft_ms: 15, tokens_per_s: 300, slots: 64}
  - name: nowhere
    engine: vllm
    gpu_class: A100-80GB
    gpus_per_node: 1
    replicas: 1
    options: {startup_s: 0.3}
"""
ADDED = """\
  - name: chat2
    engine: vllm
    gpu_class: H100-80GB
    gpus_per_node: 1
    replicas: 1
    startup_timeout_s: 30
    options: {startup_s: 0.3, ttft_ms: 15, tokens_per_s: 300, slots: 64}
"""
# The lease keeps its default TTL (10 s): NATS-NOTES asks for 5-10 s, and a stream's leader election
# after a server loss takes seconds.
SETTINGS = {**AGGRESSIVE, "LLMGW_PLACEMENT_FAILING_AFTER_S": "1"}
del SETTINGS["LLMGW_LEASE_TTL_S"]
TRAFFIC_AFTER_KILL_S = 20.0


class Receiver:
    """A webhook receiver that refuses everything (500), so the notifier retries and logs its failures."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.paths.append(self.path)
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Run:
    topo: Topology
    key: str
    receiver: Receiver
    # Every secret this run handled, by what it is.
    secrets: dict[str, str] = field(default_factory=dict)


def _keys_create(topo: Topology, name: str) -> str:
    r = topo.cli(f"keys-create-{name}", "keys", "create", "--name", name, "-o", "json")
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["key"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = Path(tmp_path_factory.mktemp("natscluster"))
    topo = Topology(root, prefix="ncl", settings=dict(SETTINGS), catalog=CATALOG, auth=True, nodes=NODES)
    receiver = Receiver()
    try:
        topo.start_nats()
        assert topo.natscluster is not None  # start_nats made it
        topo.natscluster.wait_meta_leader()
        # Before any service: `llmgw keys create` makes the keys bucket itself (it must be R3 too).
        key = _keys_create(topo, "traffic")
        probe_key = _keys_create(topo, "probe")
        topo.start_controlplane("cp-a")
        # Only the control plane may create buckets: the other roles bind to what it made.
        asyncio.run(
            eventually(
                lambda: _replicas_of_everything(topo),
                timeout=30,
                every=0.2,
                what="the control plane to make the buckets",
                tolerate=BUS_ERRORS,
            )
        )
        topo.start_router("router")
        for n in NODES:
            topo.start_agent(n)
        topo.start_notifier(probe_key)
        topo.wait_router("router")
        asyncio.run(wait_serving(topo.router_url(), key, timeout=60))
        yield Run(topo, key, receiver, {"traffic key": key, "probe key": probe_key})
    finally:
        topo.close()
        receiver.close()


async def _connect(topo: Topology) -> NATS:
    return await bus.connect(BusSettings(**topo.bus_settings("admin")), "natscluster-test")


async def _replicas_of_everything(topo: Topology) -> dict[str, int] | None:
    nc = await _connect(topo)
    try:
        js = nc.jetstream()
        s = Subjects(topo.prefix)
        out = {}
        for b in (s.bucket_assign, s.bucket_routing, s.bucket_desired, s.bucket_replicas, s.bucket_keys):
            out[f"KV_{b}"] = (await js.stream_info(f"KV_{b}")).config.num_replicas or 1
        out[s.events_stream] = (await js.stream_info(s.events_stream)).config.num_replicas or 1
        return out
    except nats.js.errors.NotFoundError:
        return None
    finally:
        await nc.close()


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*nats \(([^)]*)\): (disconnected|reconnected)")


def nats_events_after(topo: Topology, since: float) -> dict[str, dict[str, float]]:
    """Per process log: seconds after ``since`` (wall clock) of its first bus disconnect and reconnect."""
    out: dict[str, dict[str, float]] = {}
    for name, p in topo.procs.items():
        try:
            lines = p.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = _STAMP.match(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if t < since - 0.5:  # log stamps have millisecond resolution; the kill's own stamp is exact
                continue
            out.setdefault(name, {}).setdefault(m.group(3), round(t - since, 2))
    return out


async def test_server_kill_keeps_serving_placement_and_ctl(run: Run) -> None:
    topo, key = run.topo, run.key
    nc_ = topo.natscluster
    assert nc_ is not None

    replicas = await _replicas_of_everything(topo)
    assert replicas is not None
    assert set(replicas.values()) == {3}, f"buckets and the events stream should be R3: {replicas}"

    victim_name = await asyncio.to_thread(nc_.meta_leader)
    assert victim_name is not None, nc_.logs_tail()
    victim = nc_.index(victim_name)
    traffic = Traffic(topo.router_url(), key, clients=4).start()
    try:
        await traffic.run_for(2.0)
        t_kill, wall_kill = time.monotonic(), time.time()
        await asyncio.to_thread(nc_.kill, victim)

        def new_leader() -> str | None:
            leader = nc_.meta_leader()
            return leader if leader != victim_name else None

        ctl_tries: list[bool] = []

        def ctl_nodes() -> dict[str, str] | None:
            r = topo.cli("ctl-nodes", "ctl", "nodes", "-o", "json", timeout=20)
            ctl_tries.append(r.returncode == 0)
            if r.returncode != 0:
                return None
            states = {n["name"]: n["state"] for n in json.loads(r.stdout)["nodes"]}
            return states if all(states.get(n) == "ready" for n in NODES) else None

        # From the moment of the kill, concurrently: the servers elect a leader; ctl is asked.
        (leader, leader_s), (nodes, nodes_s) = await asyncio.gather(
            timed("a new meta leader among the two survivors", lambda: asyncio.to_thread(new_leader), 30),
            timed("`llmgw ctl nodes` to list both nodes ready", lambda: asyncio.to_thread(ctl_nodes), 30),
        )

        # Placement: a catalog change made after the kill is placed and served.
        catalog2 = topo.root / "catalog2.yaml"
        catalog2.write_text(CATALOG + ADDED)

        def apply() -> str | None:
            r = topo.cli("ctl-catalog-apply", "ctl", "catalog", "apply", str(catalog2), timeout=20)
            return r.stdout if r.returncode == 0 else None

        applied = await eventually(
            lambda: asyncio.to_thread(apply),
            timeout=30,
            every=0.2,
            what="`llmgw ctl catalog apply` to be accepted",
            tolerate=BUS_ERRORS,
        )
        assert applied is not None
        apply_s = time.monotonic() - t_kill
        # A try whose answer was lost in the election may have applied it already: then "no change".
        shown = await asyncio.to_thread(topo.cli, "ctl-catalog-show", "ctl", "catalog", "show", timeout=20)
        assert "chat2" in applied or ("no change" in applied and "chat2" in shown.stdout), (
            applied,
            shown.stdout,
        )
        t_apply = time.monotonic()
        await wait_serving(topo.router_url(), key, model="chat2", timeout=40)
        served_s = time.monotonic() - t_apply
        # Traffic goes on well past the servers' elections (a few seconds) and a lease's lifetime.
        await traffic.run_for(max(0.0, TRAFFIC_AFTER_KILL_S - (time.monotonic() - t_kill)))
    finally:
        await traffic.stop()

    after = traffic.started_after(t_kill, "started after the kill")
    in_flight = traffic.in_flight_at(t_kill, "in flight at the kill")
    noticed = nats_events_after(topo, wall_kill)
    report = (
        f"killed {victim_name} (meta leader) under 4 streaming clients; new meta leader {leader} after "
        f"{leader_s:.2f}s\n  {traffic.all('all requests').line()}\n  {in_flight.line()}\n  {after.line()}\n"
        f"  after the kill: ctl nodes answered at {nodes_s:.2f}s ({ctl_tries.count(False)} failed call(s) "
        f"before): {nodes}; catalog apply accepted at "
        f"{apply_s:.2f}s; chat2 served {served_s:.2f}s after the apply\n"
        f"  bus disconnect/reconnect per process, seconds after the kill: {noticed}\n"
        f"  replicas: {replicas}"
    )
    print(report)
    assert traffic.all().records, report
    assert not traffic.all().failed, report + "\n" + topo.diagnostics()
    # Every client that was on the killed server noticed it and came back on a survivor.
    for name, seen in noticed.items():
        assert "reconnected" in seen, f"{name} lost the bus and never came back\n{report}"
    assert nc_.alive() == sorted(set(range(3)) - {victim}), nc_.alive()
    # Nothing deletes routing keys here: a follower that believed so read a short listing as truth.
    assert "was deleted" not in topo.procs["router"].tail(400), topo.procs["router"].tail(40)


def _bearer(base: str, key: str, model: str = "chat", stream: bool = False) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": stream}
    r = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    return r.status_code


async def test_no_secret_reaches_a_log(run: Run) -> None:
    """Keys (and their hashes), webhook URLs and secret, NATS passwords: none in any log of the run.

    Closes the topology (shutdown logs count too): it is the module's last test.
    """
    topo = run.topo
    hook_secret = "whsec-" + secrets.token_hex(16)
    slack_path = (
        f"/services/T{secrets.token_hex(4).upper()}/B{secrets.token_hex(4).upper()}/{secrets.token_hex(12)}"
    )
    json_path = f"/hooks/{secrets.token_hex(12)}"
    base_hook = f"http://127.0.0.1:{run.receiver.port}"
    for name, path, fmt, extra in (
        ("slack", slack_path, "slack", []),
        ("json", json_path, "json", ["--webhook-secret", hook_secret]),
    ):
        r = await asyncio.to_thread(
            topo.cli,
            f"setup-{name}",
            "setup", "--webhook", base_hook + path, "--webhook-format", fmt, *extra, "--no-input",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    # An event after the webhooks exist (their consumers start from when they were configured).
    catalog3 = topo.root / "catalog3.yaml"
    catalog3.write_text(CATALOG + ADDED + ADDED.replace("chat2", "nowhere2").replace("H100", "A100"))
    r = await asyncio.to_thread(
        topo.cli, "ctl-catalog-apply-3", "ctl", "catalog", "apply", str(catalog3), timeout=20
    )
    assert r.returncode == 0, r.stderr
    extra_key = await asyncio.to_thread(_keys_create, topo, "secrets")
    revoked = await asyncio.to_thread(_keys_create, topo, "revoked")
    r = await asyncio.to_thread(topo.cli, "keys-revoke", "keys", "revoke", "revoked")
    assert r.returncode == 0, r.stderr
    wrong = ["sk-" + secrets.token_urlsafe(24), extra_key[:-3] + "xyz", "not-a-key-" + secrets.token_hex(8)]

    base = topo.router_url()
    codes = {
        "good": [
            await asyncio.to_thread(_bearer, base, k, "chat", s)
            for k in (run.key, extra_key)
            for s in (False, True)
        ],
        "wrong": [await asyncio.to_thread(_bearer, base, k) for k in wrong],
        "revoked": [],
    }

    async def refused() -> bool:
        code = await asyncio.to_thread(_bearer, base, revoked)
        codes["revoked"].append(code)
        return code == 401

    await eventually(
        refused, timeout=15, every=0.2, what="the revoked key to be refused", tolerate=BUS_ERRORS
    )
    assert set(codes["good"]) == {200}, codes
    assert set(codes["wrong"]) == {401}, codes

    # Both webhooks were tried (placement.failing for 'nowhere') and refused at least twice, so the
    # notifier went through its failure and retry paths.
    async def both_tried_twice() -> bool:
        return all(run.receiver.paths.count(p) >= 2 for p in (slack_path, json_path))

    await eventually(
        both_tried_twice,
        timeout=30,
        every=0.2,
        what="both webhooks to be POSTed to twice",
        tolerate=BUS_ERRORS,
    )

    await asyncio.to_thread(topo.close)
    found = await asyncio.to_thread(
        scan, topo.root, _secrets_of(run, topo, extra_key, revoked, wrong, hook_secret, slack_path, json_path)
    )
    logs = await asyncio.to_thread(service_logs, topo.root)
    print(
        f"scanned {len(logs)} log files ({sum(p.stat().st_size for p in logs)} bytes): {[p.name for p in logs]}"
    )
    assert len([p for p in logs if p.name.startswith(("agent-", "cp-", "router", "notifier", "nats-"))]) >= 7
    assert not found, "secrets in logs:\n" + "\n".join(found)


def _secrets_of(
    run: Run,
    topo: Topology,
    extra_key: str,
    revoked: str,
    wrong: list[str],
    hook_secret: str,
    slack_path: str,
    json_path: str,
) -> dict[str, str]:
    out = dict(run.secrets)
    out.update({"secrets key": extra_key, "revoked key": revoked, "webhook secret": hook_secret})
    out.update({f"wrong key {i}": k for i, k in enumerate(wrong)})
    for what, k in list(out.items()):
        if "key" in what:
            out[f"sha256 of {what}"] = hashlib.sha256(k.encode()).hexdigest()
    # The distinctive part of each webhook path (the host and port are no secret).
    out["slack webhook path"] = slack_path.rsplit("/", 2)[-1]
    out["slack webhook path (team/bot)"] = slack_path.split("/", 3)[2]
    out["json webhook path"] = json_path.rsplit("/", 1)[-1]
    for user, role in topo.roles.items():
        out[f"NATS password of {user}"] = role.password
    return out


def scan(root: Path, secrets_: dict[str, str]) -> list[str]:
    """``file:line: what`` for every secret found in a log file under ``root``."""
    found = []
    for path in service_logs(root):
        text = path.read_text(errors="replace")
        for what, value in secrets_.items():
            if value in text:
                for n, line in enumerate(text.splitlines(), 1):
                    if value in line:
                        found.append(f"{path.relative_to(root)}:{n}: {what}: {line[:300]}")
    return found


def test_scan_finds_a_planted_secret(tmp_path: Path) -> None:
    """The grep itself can fail: a secret written into an engine log deep in a state dir is found."""
    d = tmp_path / "agents" / "n1" / "engines"
    d.mkdir(parents=True)
    (d / "r1.log").write_text("ok\nAuthorization: Bearer sk-planted\n")
    (tmp_path / "nats-1" / "jetstream").mkdir(parents=True)
    (tmp_path / "nats-1" / "jetstream" / "blk.log").write_text("sk-planted")  # the store: not a log
    found = scan(tmp_path, {"key": "sk-planted"})
    assert found == ["agents/n1/engines/r1.log:2: key: Authorization: Bearer sk-planted"]
