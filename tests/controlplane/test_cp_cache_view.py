"""Issue 32's operator view: each router's cache figures merged per model, and how `ctl models` shows them."""

from __future__ import annotations

from llmgw_cli.ctl_render import render_models
from llmgw_common.ctl import ModelInfo, ModelsReply
from llmgw_common.router_messages import DemandReport, ModelCache, ModelDemand
from llmgw_controlplane.scheduler.demand import DemandBook, merge_cache


def report(router: str, at: float, **models: ModelCache | None) -> DemandReport:
    return DemandReport(
        router=router, since=0.0, sent_at=at, models={m: ModelDemand(cache=c) for m, c in models.items()}
    )


def test_predictions_add_up_over_routers_and_the_engines_speak_once() -> None:
    a = ModelCache(
        mode="events", prompt_tokens=1000, predicted_hit_tokens=800, engine_queries=5000, engine_hits=3000,
        index_blocks=120, event_lag_ms=4.0,
    )  # fmt: skip
    b = ModelCache(
        mode="events", prompt_tokens=3000, predicted_hit_tokens=1200, engine_queries=4000, engine_hits=3900,
        index_blocks=90, event_lag_ms=30.0,
    )  # fmt: skip
    got = merge_cache([a, b])
    assert got.routers == 2
    assert got.predicted_hit_rate == 2000 / 4000  # summed: each router counts only its own requests
    # The same engines seen by both: the router seeing more of their counters, not the sum of both.
    assert got.engine_hit_rate == 3000 / 5000
    assert got.index_blocks == 120
    assert got.event_lag_ms == 30.0


def test_no_traffic_is_unknown_not_zero() -> None:
    got = merge_cache([ModelCache(mode="approximate")])
    assert got.predicted_hit_rate is None and got.engine_hit_rate is None and got.event_lag_ms is None


def test_book_keeps_only_models_routed_by_cache_and_forgets_stale_routers() -> None:
    book = DemandBook(stale_s=5.0)
    book.add(report("r1", 100.0, chat=ModelCache(mode="events", prompt_tokens=10), embed=None), 100.0)
    assert set(book.cache(101.0)) == {"chat"}
    assert book.cache(200.0) == {}  # r1 went silent: nothing known, not a stale figure


def test_a_negative_figure_is_refused() -> None:
    book = DemandBook(stale_s=5.0)
    book.add(report("r1", 100.0, chat=ModelCache(mode="events", prompt_tokens=-1)), 100.0)
    assert book.cache(100.5) == {}


def test_ctl_models_shows_predicted_against_engine_hit_rate() -> None:
    info = merge_cache(
        [
            ModelCache(
                mode="events", prompt_tokens=100, predicted_hit_tokens=90, engine_queries=10, engine_hits=8
            )
        ]
    )
    out = render_models(ModelsReply(models=(ModelInfo(name="chat", engine="vllm", cache=info),)))
    row = next(line for line in out.splitlines() if line.startswith("chat ") and "events" in line)
    assert "0.90" in row and "0.80" in row
    plain = render_models(ModelsReply(models=(ModelInfo(name="chat", engine="vllm"),)))
    assert "CACHE ROUTING" not in plain
