"""Per-key Prometheus counters with bounded label cardinality (keymetrics.py): the busiest keys by
name, the rest summed under key="_other", labels kept so every series only grows; on a real router's
/metrics."""

from __future__ import annotations

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw_common.messages import ApiKeyRecord
from llmgw_router.tenancy.keymetrics import KeyUsageMetrics
from llmgw_router.tenancy.keys import KeyTable
from llmgw_router.tenancy.usage import UsageTable
from llmgw_runtime.apikeys import generate_key, hash_key
from tests.router.router_helpers import EngineFactory, PortFactory, RouterFactory, StaticFile


def _scrape(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            if s.name.startswith("llmgw_router_key_") and s.name.endswith("_total"):
                out[(s.name, s.labels["key"])] = s.value
    return out


def test_top_keys_are_labelled_the_rest_summed_and_series_only_grow() -> None:
    keys = KeyTable()
    for i in range(5):
        keys.put(ApiKeyRecord(id=f"k{i}", name=f"team{i}", hash=f"h{i}", created=0.0))
    usage = UsageTable(0.0, clock=lambda: 10.0)
    for i in range(5):
        for _ in range(i + 1):
            usage.add(f"k{i}", "m1", (10 * (i + 1), 1))
    reg = CollectorRegistry()
    reg.register(KeyUsageMetrics(usage, keys, top_n=2))
    first = _scrape(reg)
    tok = "llmgw_router_key_prompt_tokens_total"
    # k4 and k3 used most; k0..k2 summed: 10*1 + 20*2 + 30*3.
    assert {k for (n, k) in first if n == tok} == {"k4", "k3", "_other"}
    assert first[(tok, "k4")] == 250 and first[(tok, "_other")] == 140
    assert first[("llmgw_router_key_requests_total", "_other")] == 6
    # k0 becomes the busiest: it stays under _other (a label moved would make both series jump).
    for _ in range(50):
        usage.add("k0", "m1", (100, 1))
    second = _scrape(reg)
    assert {k for (n, k) in second if n == tok} == {"k4", "k3", "_other"}
    assert all(second[s] >= v for s, v in first.items())
    assert second[(tok, "_other")] == 140 + 5000


async def test_a_routers_metrics_carry_the_key_counters(
    engines: EngineFactory, routers: RouterFactory, static_file: StaticFile, port: PortFactory
) -> None:
    eng = await engines("m1")
    key = generate_key()
    static = static_file({"m1": [eng.url]}, keys=[{"name": "team-a", "hash": hash_key(key)}])
    r = await routers(static, admin_port=port())
    body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        for _ in range(3):
            async with s.post(f"http://127.0.0.1:{r.port}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
        async with s.get(f"http://127.0.0.1:{r.admin_port}/metrics") as resp:
            text = await resp.text()
    line = next(x for x in text.splitlines() if x.startswith("llmgw_router_key_requests_total{"))
    assert 'name="team-a"' in line and line.endswith(" 3.0")
