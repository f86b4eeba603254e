"""The console's Overview shows scaling (issue 13): cold models, wakes, cold starts, evictions."""

from __future__ import annotations

from llmgw_common.ctl import EvictionInfo, StatusReply
from tests.console.console_fleet import NOW, FixedSource
from tests.console.console_pages import client, get, rows


async def test_overview_shows_cold_waking_cold_starts_and_evictions() -> None:
    status = StatusReply(
        cold=("a",),
        waking={"b": "1 replica starting on n1"},
        cold_starts={"b": 12.5},
        evictions=(
            EvictionInfo(
                at=NOW - 60, replica_id="a-1", model="a", for_model="b", nodes=("n1",), reason="idle for 5m"
            ),
        ),
    )
    async with client(FixedSource(status_reply=status)) as c:
        page = await get(c, "/")
    assert rows(page, "scaling")[1:] == [
        "a cold (scaled to zero) -",
        "b waking 1 replica starting on n1 12.5s",
    ]
    assert rows(page, "evictions")[1:] == ["1m ago a-1 a n1 b idle for 5m"]


async def test_overview_without_scaling_says_so() -> None:
    async with client(FixedSource(status_reply=StatusReply())) as c:
        page = await get(c, "/")
    assert rows(page, "scaling")[1:] == ["no model is cold or waking"]
    assert rows(page, "evictions")[1:] == ["none"]


async def test_models_page_shows_routing_by_cached_prefix_only_where_a_router_reports_it() -> None:
    from llmgw_common.ctl import ModelCacheInfo, ModelInfo, ModelsReply

    cache = ModelCacheInfo(
        mode="events", routers=3, predicted_hit_rate=0.91, engine_hit_rate=0.875, index_blocks=12345,
        event_lag_ms=7.4,
    )  # fmt: skip
    models = ModelsReply(
        models=(ModelInfo(name="chat", engine="vllm", cache=cache), ModelInfo(name="e", engine="sim"))
    )
    async with client(FixedSource(models_reply=models)) as c:
        page = await get(c, "/models")
    assert rows(page, "cache")[1:] == ["chat events 3 0.91 0.88 12 345 7 ms"]
    async with client(
        FixedSource(models_reply=ModelsReply(models=(ModelInfo(name="e", engine="sim"),)))
    ) as c:
        plain = await get(c, "/models")
    assert 'id="cache"' not in plain
