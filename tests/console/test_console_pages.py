"""The console's pages through the ASGI app (no socket, no browser), rendering fixed ctl replies: the
overview and each table page (columns, edge states). The numbers the real ctl handlers compute are
checked in ``test_console_built_fleet.py`` and, over the bus, in ``test_console_live.py``."""

from __future__ import annotations

import re

import httpx
from typer.testing import CliRunner

from llmgw_cli.main import app
from llmgw_common.ctl import StatusReply
from llmgw_controlplane.console.usage import UsageView
from tests.console.console_fleet import (
    HOSTILE_LOG,
    NOW,
    STATUS,
    UNHEALTHY_REASON,
    UNPLACEABLE_REASON,
    WEBHOOK,
    FixedSource,
)
from tests.console.console_pages import client, get, rows, text

# Overview.


async def test_overview_shows_status_aggregates(c: httpx.AsyncClient) -> None:
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


async def test_overview_idle_lists_only_known_idle_with_their_times(c: httpx.AsyncClient) -> None:
    page = await get(c, "/")
    idle = rows(page, "idle")[1:]
    assert idle == ["r-mistral-1 mistral-7b 2h1m", "r-qwen-1 qwen-7b >=3d"]
    # r-llama70-2's idle time is unknown: it is not idle, so it is not listed.
    assert "r-llama70-2" not in page


async def test_overview_with_nothing_idle_says_unknown_is_not_idle() -> None:
    src = FixedSource(status_reply=STATUS.model_copy(update={"idle_replicas": ()}))
    async with client(src) as c:
        page = await get(c, "/")
    assert rows(page, "idle")[1:] == ["none known (a replica no router has reported on is unknown, not idle)"]
    assert "replicas" not in src.calls  # no idle replica: the replica table is not read


async def test_overview_webhook_warning_with_the_command(c: httpx.AsyncClient) -> None:
    page = await get(c, "/")
    m = re.search(r'<div class="banner bad" id="webhook-warning">(.*?)</div>', page, re.S)
    assert m, "no webhook banner"
    # The literal the operator will type, and a command that really takes that option.
    assert "<code>llmgw setup --webhook URL</code>" in m.group(1)
    assert "--webhook" in CliRunner().invoke(app, ["setup", "--help"]).output
    assert "reaches nobody" in text(m.group(1))
    # Shown once (the status warning about it is not repeated), the other warning is listed.
    assert text(page).count("webhook") == 2  # "No webhook configured" and the command
    assert "2 model(s) without a ready replica: deepseek-671b, gemma-crash" in text(page)


async def test_overview_no_webhook_banner_once_one_is_set() -> None:
    status = STATUS.model_copy(update={"warnings": STATUS.warnings[1:]})
    async with client(FixedSource(status_reply=status, cluster=WEBHOOK)) as c:
        page = await get(c, "/")
    assert 'id="webhook-warning"' not in page
    assert "llmgw setup --webhook" not in page
    assert "2 model(s) without a ready replica" in text(page)


async def test_overview_of_an_empty_cluster() -> None:
    async with client(FixedSource(status_reply=StatusReply())) as c:
        page = await get(c, "/")
    assert rows(page, "capacity")[1:] == ["no GPU reported by any node"]
    assert rows(page, "unplaceable")[1:] == ["none"]
    assert rows(page, "weights")[1:] == ["no node has reported weights"]


async def test_standby_banner_only_on_a_standby() -> None:
    async with client(FixedSource()) as c:
        assert "on standby" not in await get(c, "/nodes")
    async with client(FixedSource(status_reply=STATUS.model_copy(update={"leader": False}))) as c:
        page = await get(c, "/nodes")
    assert "This control plane is on standby" in text(page)


# Tables.


async def test_nodes_page(c: httpx.AsyncClient) -> None:
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


async def test_nodes_page_marks_simulated_nodes() -> None:
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


async def test_nodes_page_of_a_real_fleet_has_no_sim_badge(c: httpx.AsyncClient) -> None:
    page = await get(c, "/nodes")
    assert 'class="tag sim"' not in page and 'id="simulated-warning"' not in page


async def test_overview_shows_the_simulated_warning() -> None:
    warn = "3 simulated nodes: capacity shown is not real"
    src = FixedSource(status_reply=STATUS.model_copy(update={"simulated_nodes": 3, "warnings": (warn,)}))
    async with client(src) as c:
        page = await get(c, "/")
    assert f'<div class="banner warn">{warn}</div>' in page


async def test_nodes_page_without_problems_has_no_attention_line() -> None:
    from llmgw_common.ctl import NodesReply
    from tests.console.console_fleet import NODES

    fine = tuple(
        n for n in NODES if n.state == "ready" and not (n.gpus_unhealthy or n.cordoned or n.draining)
    )
    async with client(FixedSource(nodes_reply=NodesReply(nodes=fine))) as c:
        page = await get(c, "/nodes")
    assert 'id="attention"' not in page
    assert len(rows(page, "nodes")) == len(fine) + 1


async def test_models_page(c: httpx.AsyncClient) -> None:
    page = await get(c, "/models")
    r = rows(page, "models")[1:]
    assert r[0] == "llama-70b * vllm 8xH100-80GB 2/2 ok"
    assert r[2].startswith("deepseek-671b vllm 4 nodes x 8xH100-80GB 0/1 unplaceable")
    assert "crash loop: 3 failure(s)" in r[3]


async def test_replicas_page_errors_log_tail_and_idle(c: httpx.AsyncClient) -> None:
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


async def test_placement_page_groups_refusals(c: httpx.AsyncClient) -> None:
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


async def test_placement_page_model_gone_from_catalog() -> None:
    async with client(FixedSource(explains={})) as c:
        page = await get(c, "/placement")
    assert "no longer in the catalog" in page


async def test_placement_page_when_all_is_well() -> None:
    from llmgw_common.ctl import ModelsReply

    src = FixedSource(status_reply=StatusReply(), models_reply=ModelsReply())
    async with client(src) as c:
        page = await get(c, "/placement")
    assert "Every model with desired replicas has a ready one" in page
    assert "explain" not in src.calls


async def test_usage_page(c: httpx.AsyncClient) -> None:
    page = await get(c, "/usage")
    r = rows(page, "usage")[1:]
    assert r[0] == "key-ops llama-70b 1 200 2 400 000 600 000 3 000 000"  # thin spaces group digits
    assert '<td class="n">3\u2009000\u2009000</td>' in page
    assert "from 2 router(s)" in text(page)


async def test_usage_page_without_usage() -> None:
    async with client(FixedSource(usage_view=None)) as c:
        page = await get(c, "/usage")
    assert "No usage reported yet: this control plane does not collect" in text(page)
    async with client(FixedSource(usage_view=UsageView(routers=1, since=NOW, updated_at=NOW, rows=()))) as c:
        page = await get(c, "/usage")
    assert "No usage reported yet (1 router(s) reporting, no request counted)." in text(page)
    assert 'id="usage"' not in page
