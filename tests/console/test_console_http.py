"""The console's pages through the ASGI app (no socket, no browser).

Most tests render fixed ctl replies (columns, escaping, edge states). The numbers are checked where the
real ctl handlers compute them: at the end of this file from a fleet the test feeds into a control
plane's state (cordoned, draining, lost, unhealthy), and in ``test_console_live.py`` over the bus.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llmgw_common.catalog import parse_catalog
from llmgw_common.ctl import StatusReply
from llmgw_common.messages import (
    GpuInfo,
    Heartbeat,
    Inventory,
    Marks,
    ReplicaRecord,
    ShardPlacement,
    ShardReport,
    ShardState,
)
from llmgw_common.settings import ControlPlaneSettings
from llmgw_controlplane.admin import CONSOLE_DIR, PAGES, WEBHOOK_COMMAND, CtlApiSource, build_admin_app
from llmgw_controlplane.console.usage import UsageView
from llmgw_controlplane.service import ControlPlane
from tests.console.console_fleet import (
    HOSTILE,
    HOSTILE_LOG,
    NOW,
    STATUS,
    UNHEALTHY_REASON,
    UNPLACEABLE_REASON,
    WEBHOOK,
    FixedSource,
)

PATHS = [p for p, _, _ in PAGES]


def client(source: FixedSource, **kw: object) -> httpx.AsyncClient:
    app = build_admin_app(source, clock=lambda: NOW, **kw)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8081")


@pytest.fixture
async def c() -> AsyncIterator[httpx.AsyncClient]:
    async with client(FixedSource()) as cl:
        yield cl


def text(page: str) -> str:
    """The visible text of a page, tags stripped and entities decoded, whitespace collapsed."""
    page = re.sub(r"<svg.*?</svg>", " ", page, flags=re.S)  # bars: their tooltips are not table text
    page = re.sub(r"</?(td|th|tr|div|p|pre|br|caption|table|h2|li)\b[^>]*>", " ", page)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def rows(page: str, table_id: str) -> list[str]:
    m = re.search(rf'<table[^>]*id="{table_id}".*?</table>', page, re.S)
    assert m, f"no table {table_id}"
    return [text(r) for r in re.findall(r"<tr[^>]*>(.*?)</tr>", m.group(0), re.S)]


async def get(c: httpx.AsyncClient, path: str) -> str:
    r = await c.get(path)
    assert r.status_code == 200, (path, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    return r.text


# ---------------------------------------------------------------- overview


async def test_overview_shows_status_aggregates(c):
    page = await get(c, "/")
    cap = rows(page, "capacity")
    # class, used, free, unhealthy, held, total: the unhealthy GPU is neither used nor free, and the
    # 8 healthy-but-unplaceable ones are "held", not free.
    assert "H100-80GB 20 3 1 8 32" in cap
    assert "A100-40GB 1 7 0 4 12" in cap  # the lost node's idle cards are held
    assert rows(page, "free-nodes") == ["ib-b 1"]
    t = text(page)
    for needle in (
        "nodes lost 1 ready 7",
        "replicas failed 1 ready 3",
        "models backoff 1 degraded 1 ok 1 unplaceable 1",
    ):
        assert needle in t, needle
    assert rows(page, "unplaceable")[1:] == [f"deepseek-671b 5m ago {UNPLACEABLE_REASON}"]
    assert rows(page, "weights")[1:] == ["ib-a llama-70b, mistral-7b", "ib-b qwen-7b"]
    assert "Idle ≥ 1h" in t


async def test_overview_idle_lists_only_known_idle_with_their_times(c):
    page = await get(c, "/")
    idle = rows(page, "idle")[1:]
    assert idle == ["r-mistral-1 mistral-7b 2h1m", "r-qwen-1 qwen-7b >=3d"]
    # r-llama70-2's idle time is unknown: it is not idle, so it is not listed.
    assert "r-llama70-2" not in page


async def test_overview_with_nothing_idle_says_unknown_is_not_idle():
    src = FixedSource(status_reply=STATUS.model_copy(update={"idle_replicas": ()}))
    async with client(src) as c:
        page = await get(c, "/")
    assert rows(page, "idle")[1:] == ["none known (a replica no router has reported on is unknown, not idle)"]
    assert "replicas" not in src.calls  # no idle replica: the replica table is not read


async def test_overview_webhook_warning_with_the_command(c):
    page = await get(c, "/")
    m = re.search(r'<div class="banner bad" id="webhook-warning">(.*?)</div>', page, re.S)
    assert m, "no webhook banner"
    assert WEBHOOK_COMMAND == "llmgw setup --webhook URL"
    assert f"<code>{WEBHOOK_COMMAND}</code>" in m.group(1)
    assert "reaches nobody" in text(m.group(1))
    # Shown once (the status warning about it is not repeated), the other warning is listed.
    assert text(page).count("webhook") == 2  # "No webhook configured" and the command
    assert "2 model(s) without a ready replica: deepseek-671b, gemma-crash" in text(page)


async def test_overview_no_webhook_banner_once_one_is_set():
    status = STATUS.model_copy(update={"warnings": STATUS.warnings[1:]})
    async with client(FixedSource(status_reply=status, cluster=WEBHOOK)) as c:
        page = await get(c, "/")
    assert 'id="webhook-warning"' not in page
    assert WEBHOOK_COMMAND not in page
    assert "2 model(s) without a ready replica" in text(page)


async def test_overview_of_an_empty_cluster():
    async with client(FixedSource(status_reply=StatusReply())) as c:
        page = await get(c, "/")
    assert rows(page, "capacity")[1:] == ["no GPU reported by any node"]
    assert rows(page, "unplaceable")[1:] == ["none"]
    assert rows(page, "weights")[1:] == ["no node has reported weights"]


async def test_standby_banner_only_on_a_standby():
    async with client(FixedSource()) as c:
        assert "on standby" not in await get(c, "/nodes")
    async with client(FixedSource(status_reply=STATUS.model_copy(update={"leader": False}))) as c:
        page = await get(c, "/nodes")
    assert "This control plane is on standby" in text(page)


# ---------------------------------------------------------------- tables


async def test_nodes_page(c):
    page = await get(c, "/nodes")
    r = {row.split()[0]: row for row in rows(page, "nodes")[1:]}
    assert list(r) == ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-b01", "gpu-b02", "gpu-b03", "cpu-01"]
    assert "4/3/0/1/8" in r["gpu-a02"] and UNHEALTHY_REASON in r["gpu-a02"]
    assert "0/0/8/0/8" in r["gpu-a03"] and "0/0/4/0/4" in r["gpu-b03"]  # held, as ctl counts them
    # Memory not reported: "-", never 0 (ARCHITECTURE #3).
    assert "4xA100-40GB - 96" in r["gpu-b01"]
    assert "1024 GB" in r["gpu-a01"]
    assert "cordoned" in r["gpu-a03"] and "draining · stop in 9m" in r["gpu-a04"]
    assert r["gpu-b03"].startswith("gpu-b03 lost ib-b")
    assert "weights not looked for" in r["cpu-01"]
    assert '<tr class="bad-row" id="node-gpu-b03">' in page  # the lost node is marked, not only worded
    m = re.search(r'<div class="attention" id="attention">(.*?)</div>', page, re.S)
    assert m
    assert text(m.group(1)) == (
        "Needs a look: gpu-b03 lost · gpu-a02 1 unhealthy GPU · gpu-a04 draining · gpu-a03 cordoned"
    )
    # A cordoned or lost node's free GPUs are not drawn as free capacity (its numbers stay ctl's).
    for name in ("gpu-a03", "gpu-b03"):
        row = re.search(rf'<tr[^>]*id="node-{name}">(.*?)</tr>', page, re.S)
        assert row and 'class="held"' in row.group(1) and 'class="free"' not in row.group(1)
    healthy = re.search(r'<tr[^>]*id="node-gpu-b01">(.*?)</tr>', page, re.S)
    assert healthy and 'class="free"' in healthy.group(1)


async def test_nodes_page_marks_simulated_nodes():
    from llmgw_common.ctl import NodesReply
    from tests.console.console_fleet import NODES

    sim = tuple(n.model_copy(update={"simulated": n.name in ("gpu-a01", "gpu-b01")}) for n in NODES)
    async with client(FixedSource(nodes_reply=NodesReply(nodes=sim))) as c:
        page = await get(c, "/nodes")
    badged = {
        name
        for name, row in re.findall(r'<tr[^>]*id="node-([^"]+)">(.*?)</tr>', page, re.S)
        if '<span class="tag sim"' in row
    }
    assert badged == {"gpu-a01", "gpu-b01"}
    m = re.search(r'<div class="banner warn" id="simulated-warning">(.*?)</div>', page, re.S)
    assert m and text(m.group(1)) == "2 simulated nodes: capacity shown is not real (marked SIM)."


async def test_nodes_page_of_a_real_fleet_has_no_sim_badge(c):
    page = await get(c, "/nodes")
    assert 'class="tag sim"' not in page and 'id="simulated-warning"' not in page


async def test_overview_shows_the_simulated_warning():
    warn = "3 simulated nodes: capacity shown is not real"
    src = FixedSource(status_reply=STATUS.model_copy(update={"simulated_nodes": 3, "warnings": (warn,)}))
    async with client(src) as c:
        page = await get(c, "/")
    assert f'<div class="banner warn">{warn}</div>' in page


async def test_nodes_page_without_problems_has_no_attention_line():
    from llmgw_common.ctl import NodesReply
    from tests.console.console_fleet import NODES

    fine = tuple(
        n for n in NODES if n.state == "ready" and not (n.gpus_unhealthy or n.cordoned or n.draining)
    )
    async with client(FixedSource(nodes_reply=NodesReply(nodes=fine))) as c:
        page = await get(c, "/nodes")
    assert 'id="attention"' not in page
    assert len(rows(page, "nodes")) == len(fine) + 1


async def test_models_page(c):
    page = await get(c, "/models")
    r = rows(page, "models")[1:]
    assert r[0] == "llama-70b * vllm 8xH100-80GB 2/2 ok"
    assert r[2].startswith("deepseek-671b vllm 4 nodes x 8xH100-80GB 0/1 unplaceable")
    assert "crash loop: 3 failure(s)" in r[3]


async def test_replicas_page_errors_log_tail_and_idle(c):
    page = await get(c, "/replicas")
    r = rows(page, "replicas")
    by_id = {row.split()[0]: row for row in r[1:] if row.startswith("r-")}
    assert by_id["r-llama70-2"].split()[-2] == "-"  # unknown idle is "-"
    assert "draining" in by_id["r-llama70-2"]
    assert by_id["r-qwen-1"].split()[-2] == ">=3d"
    assert by_id["r-mistral-1"].split()[-2] == "2h1m"
    assert "0: cpu-01 [cpu] failed" in by_id["r-gemma-1"]
    detail = [row for row in r if row.startswith("shard 0 on cpu-01")]
    assert detail == [
        f"shard 0 on cpu-01: engine exited with code 1 loading model /models/gemma {HOSTILE_LOG} error: out of memory"
    ]
    assert '<pre class="log">loading model /models/gemma\n' in page


async def test_placement_page_groups_refusals(c):
    page = await get(c, "/placement")
    t = text(page)
    assert "deepseek-671b cannot be placed · 5m ago" in t
    assert UNPLACEABLE_REASON in t
    assert "3 has 0 free H100-80GB GPUs, needs 8 gpu-a01, gpu-a04" not in t  # grouped by exact reason
    assert "2 has 0 free H100-80GB GPUs, needs 8 gpu-a01, gpu-a04" in t
    assert "1 cordoned gpu-a03" in t
    assert rows(page, "others")[1:] == [
        "mistral-7b degraded 1/2 starting on gpu-a03",
        "gemma-crash backoff 0/1 crash loop: 3 failure(s), last: exit 1; next attempt in 40s",
    ]


async def test_placement_page_model_gone_from_catalog():
    async with client(FixedSource(explains={})) as c:
        page = await get(c, "/placement")
    assert "no longer in the catalog" in page


async def test_placement_page_when_all_is_well():
    from llmgw_common.ctl import ModelsReply

    src = FixedSource(status_reply=StatusReply(), models_reply=ModelsReply())
    async with client(src) as c:
        page = await get(c, "/placement")
    assert "Every model with desired replicas has a ready one" in page
    assert "explain" not in src.calls


async def test_usage_page(c):
    page = await get(c, "/usage")
    r = rows(page, "usage")[1:]
    assert r[0] == "key-ops llama-70b 1 200 2 400 000 600 000 3 000 000"  # thin spaces group digits
    assert '<td class="n">3\u2009000\u2009000</td>' in page
    assert "from 2 router(s)" in text(page)


async def test_usage_page_without_usage():
    async with client(FixedSource(usage_view=None)) as c:
        page = await get(c, "/usage")
    assert "No usage reported yet: this control plane does not collect" in text(page)
    async with client(FixedSource(usage_view=UsageView(routers=1, since=NOW, updated_at=NOW, rows=()))) as c:
        page = await get(c, "/usage")
    assert "No usage reported yet (1 router(s) reporting, no request counted)." in text(page)
    assert 'id="usage"' not in page


# ---------------------------------------------------------------- safety


@pytest.mark.parametrize("path", PATHS)
async def test_everything_escaped_and_no_script(c, path):
    page = await get(c, path)
    assert "<script" not in page.lower()
    assert "<img" not in page.lower()
    assert "onerror=alert" not in page.replace("&lt;img src=x onerror=alert(1)&gt;", "")


async def test_hostile_strings_shown_as_text(c):
    nodes = await get(c, "/nodes")
    assert html.escape(HOSTILE, quote=True) in nodes or "&lt;script&gt;" in nodes
    assert HOSTILE in text(nodes)  # shown, as text
    replicas = await get(c, "/replicas")
    assert "&lt;img src=x onerror=alert(1)&gt; &amp; done" in replicas
    assert HOSTILE in text(await get(c, "/usage"))


def test_every_route_is_get_only():
    app = build_admin_app(FixedSource())  # type: ignore[arg-type]
    routes = [r for r in app.routes if hasattr(r, "methods")]
    assert {r.path for r in routes} == {*PATHS, "/style.css", "/debug/stats"}
    for r in routes:
        assert r.methods == {"GET"}, (r.path, r.methods)


@pytest.mark.parametrize("path", [*PATHS, "/style.css", "/debug/stats"])
@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
async def test_writes_get_405(c, path, method):
    r = await c.request(method, path, content=b"x")
    assert r.status_code == 405


async def test_no_docs_or_openapi(c):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert (await c.get(path)).status_code == 404


async def test_security_headers(c):
    r = await c.get("/")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "style-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "script-src" not in csp  # no script of any kind is allowed by default-src 'none'
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8081", "10.0.0.5:8081", "0.0.0.0:8081", ""])
async def test_non_loopback_host_refused(c, host):
    r = await c.get("/", headers={"host": host})
    assert r.status_code == 400
    assert "loopback host name" in r.text
    assert "gpu-a01" not in r.text


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:8081", "[::1]:8081", "127.0.0.2:1"])
async def test_loopback_hosts_served(c, host):
    r = await c.get("/nodes", headers={"host": host})
    assert r.status_code == 200 and "gpu-a01" in r.text


async def test_public_listener_serves_any_host():
    async with client(FixedSource(), loopback_only=False) as c:
        r = await c.get("/", headers={"host": "console.example:8081"})
    assert r.status_code == 200


async def test_forwarded_headers_change_nothing(c):
    plain = await c.get("/")
    fwd = await c.get(
        "/",
        headers={
            "x-forwarded-host": "evil.example",
            "x-forwarded-for": "203.0.113.9",
            "x-forwarded-proto": "https",
            "forwarded": "host=evil.example",
        },
    )
    assert fwd.status_code == 200
    assert fwd.text == plain.text
    assert "evil.example" not in fwd.text
    # Every link stays a path on this listener.
    assert not re.search(r'(href|src)="(?!/|\?)', fwd.text)


# ---------------------------------------------------------------- plumbing


async def test_refresh(c):
    assert '<meta http-equiv="refresh" content="10">' in await get(c, "/")
    paused = await get(c, "/nodes?refresh=0")
    assert 'http-equiv="refresh"' not in paused and "paused" in paused
    assert '<meta http-equiv="refresh" content="60">' in await get(c, "/models?refresh=60")
    assert (await c.get("/?refresh=-1")).status_code == 422
    assert (await c.get("/?refresh=x")).status_code == 422


async def test_source_unavailable_gives_503_page():
    async with client(
        FixedSource(fail="status: the control plane could not read its state from NATS (timeout)")
    ) as c:
        for path in [*PATHS, "/debug/stats"]:
            r = await c.get(path)
            assert r.status_code == 503, path
            assert "could not read its state from NATS (timeout)" in r.text
            assert r.headers["content-security-policy"]
        stats = await c.get("/style.css")
        assert stats.status_code == 200


async def test_debug_stats(c):
    await get(c, "/")
    await get(c, "/")
    await get(c, "/nodes")
    r = await c.get("/debug/stats")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    d = r.json()
    assert d["passes"] == 42 and d["last_pass_ms"] == 1.5 and d["nodes"] == 8
    assert d["console"]["requests"] == {"overview": 2, "nodes": 1}
    assert d["console"]["render_max_ms"]["overview"] > 0


async def test_stylesheet_served_from_the_package(c):
    r = await c.get("/style.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")
    assert r.content == (CONSOLE_DIR / "style.css").read_bytes()
    assert CONSOLE_DIR.parent.name == "llmgw_controlplane"
    for _, key, _ in PAGES:
        assert (CONSOLE_DIR / f"{key}.html").is_file()


@pytest.mark.parametrize("path", PATHS)
async def test_every_page_has_the_nav_and_marks_itself(c, path):
    page = await get(c, path)
    for href, _, label in PAGES:
        assert f'href="{href}"' in page and label in page
    assert page.count('aria-current="page"') == 1
    assert re.search(rf'<a href="{re.escape(path)}" class="on"', page)


# ---------------------------------------------------------------- numbers from the real handlers


def _gpus(n: int, cls: str, bad: int | None = None) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{cls}-{i}",
            name=cls,
            gpu_class=cls,
            memory_mb=81559,
            healthy=i != bad,
            reasons=("XID 79",) if i == bad else (),
        )
        for i in range(n)
    )


@dataclass(frozen=True)
class BuiltNode:
    name: str
    fabric: str | None
    gpus: tuple[GpuInfo, ...]
    used: tuple[int, ...] = ()  # GPUs its one replica holds
    heard_ago_s: float = 1.0
    cordoned: bool = False
    draining: bool = False


# Every case the overview must count differently: a partly used node with an unhealthy GPU, a cordoned
# idle node (its GPUs are held, not free), a draining busy one, a free one, a lost one (its idle GPUs are
# held too: counted, never free) and a node without GPUs.
BUILT = (
    BuiltNode("gpu-a01", "ib-a", _gpus(8, "H100-80GB", bad=7), used=(0, 1, 2, 3)),
    BuiltNode("gpu-a02", "ib-a", _gpus(8, "H100-80GB"), cordoned=True),
    BuiltNode("gpu-a03", "ib-a", _gpus(8, "H100-80GB"), used=tuple(range(8)), draining=True),
    BuiltNode("gpu-b01", "ib-b", _gpus(4, "A100-40GB")),
    BuiltNode("gpu-b02", "ib-b", _gpus(4, "A100-40GB"), heard_ago_s=1000.0),
    BuiltNode("cpu-01", None, ()),
)
BUILT_CATALOG = "models:\n  - name: m\n    engine: sim\n    replicas: 2\n    gpu_class: H100-80GB\n"


@pytest.fixture
async def built(nats_server: Any, nc: Any, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    """The console over the real ctl handlers of a control plane (started, not leading) whose state is
    fed the fleet above, on a clock the test holds."""
    s = ControlPlaneSettings(
        nats_urls=[nats_server.url], prefix=prefix, heartbeat_interval_s=2.0, node_lost_s=30.0
    )
    cp = ControlPlane(s, nc, clock=lambda: NOW)
    await cp.start()
    cp.state.set_catalog(parse_catalog(BUILT_CATALOG), 1)
    for n in BUILT:
        heard = NOW - n.heard_ago_s
        inv = Inventory(node=n.name, boot_id="b", sent_at=heard, gpus=n.gpus, fabric=n.fabric, cpus=8)
        cp.state.on_inventory(inv, heard)
        shards: tuple[ShardReport, ...] = ()
        if n.used:
            rid = f"r-{n.name}"
            cp.state.put_replica(
                ReplicaRecord(
                    id=rid,
                    model="m",
                    created=NOW - 60,
                    shards=(ShardPlacement(shard=0, node=n.name, gpus=n.used, port=20000),),
                )
            )
            shards = (ShardReport(replica_id=rid, shard=0, model="m", state=ShardState.READY, port=20000),)
        cp.state.on_heartbeat(Heartbeat(node=n.name, boot_id="b", seq=1, sent_at=heard, shards=shards), heard)
    cp.state.marks = Marks(
        cordoned=tuple(n.name for n in BUILT if n.cordoned),
        draining={n.name: NOW + 600 for n in BUILT if n.draining},
    )
    cp.state.judge(NOW)
    app = build_admin_app(CtlApiSource(cp.api), clock=lambda: NOW)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8081"
    ) as cl:
        yield cl


def _lost(n: BuiltNode) -> bool:
    return n.heard_ago_s > 30.0


async def test_overview_numbers_are_the_built_fleets(built: httpx.AsyncClient) -> None:
    """Computed here from the fleet's description, the way ARCHITECTURE says to count: unhealthy is
    neither used nor free (#2), idle GPUs of a cordoned, draining or lost node are held: they exist but
    are not capacity."""
    cap: dict[str, Counter[str]] = {}
    free_nodes: Counter[str] = Counter()
    for n in BUILT:
        for g in n.gpus:
            c = cap.setdefault(g.gpu_class, Counter())
            c["total"] += 1
            if not g.healthy:
                c["unhealthy"] += 1
            elif g.index in n.used:
                c["used"] += 1
            elif n.cordoned or n.draining or _lost(n):
                c["held"] += 1
            else:
                c["free"] += 1
        if n.gpus and not (_lost(n) or n.cordoned or n.draining or n.used):
            free_nodes[n.fabric or "-"] += 1
    page = await get(built, "/")
    assert rows(page, "capacity")[1:] == [
        f"{k} {v['used']} {v['free']} {v['unhealthy']} {v['held']} {v['total']}"
        for k, v in sorted(cap.items())
    ]
    assert rows(page, "free-nodes") == [f"{f} {k}" for f, k in sorted(free_nodes.items())]
    lost = sum(1 for n in BUILT if _lost(n))
    assert f"nodes lost {lost} ready {len(BUILT) - lost}" in text(page)


async def test_nodes_numbers_are_the_built_fleets(built: httpx.AsyncClient) -> None:
    page = await get(built, "/nodes")
    by_name = {r.split()[0]: r for r in rows(page, "nodes")[1:]}
    assert sorted(by_name) == sorted(n.name for n in BUILT)
    for n in BUILT:
        row = by_name[n.name]
        assert row.split()[1] == ("lost" if _lost(n) else "ready"), row
        if n.gpus:
            bad = sum(1 for g in n.gpus if not g.healthy)
            # used/free/held/unhealthy/total, the same count as the overview's: a cordoned, draining or
            # lost node's idle GPUs are held, never free.
            idle = len(n.gpus) - len(n.used) - bad
            held = n.cordoned or n.draining or _lost(n)
            free, kept = (0, idle) if held else (idle, 0)
            assert f"{len(n.used)}/{free}/{kept}/{bad}/{len(n.gpus)}" in row, row
    attention = re.search(r'<div class="attention" id="attention">(.*?)</div>', page, re.S)
    assert attention is not None
    assert text(attention.group(1)) == (
        "Needs a look: gpu-b02 lost · gpu-a01 1 unhealthy GPU · gpu-a03 draining · gpu-a02 cordoned"
    )
