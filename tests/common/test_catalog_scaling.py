"""Catalog fields for scaling to zero (issue 13): ``min_replicas``, ``idle_after``, and the watch opt-in."""

from __future__ import annotations

import pytest

from llmgw_common.catalog import CatalogError, catalog_to_yaml, parse_catalog


def test_min_replicas_defaults_to_replicas_so_nothing_scales() -> None:
    cat = parse_catalog("models:\n  - {name: a, engine: sim, replicas: 3}")
    p = cat.get("a")
    assert p is not None
    assert p.floor == 3
    assert not p.scales


def test_scale_to_zero_with_idle_after_parses_and_round_trips() -> None:
    cat = parse_catalog("models:\n  - {name: a, engine: sim, replicas: 2, min_replicas: 0, idle_after: 30m}")
    p = cat.get("a")
    assert p is not None
    assert (p.floor, p.idle_after, p.scales) == (0, 1800.0, True)
    assert parse_catalog(catalog_to_yaml(cat)) == cat


def test_every_scaling_problem_is_listed_at_once() -> None:
    bad = """
models:
  - {name: a, engine: sim, replicas: 1, min_replicas: 0}
  - {name: b, engine: sim, replicas: 1, min_replicas: 2}
  - {name: c, engine: sim, min_replicas: 0, idle_after: 10m, watch: {}}
  - {name: d, engine: sim, min_replicas: 0, idle_after: later}
  - {name: e, engine: sim, min_replicas: -1, idle_after: 1m}
"""
    with pytest.raises(CatalogError) as e:
        parse_catalog(bad)
    text = "\n".join(e.value.problems)
    for fragment in [
        "model 'a': min_replicas 0 is below replicas 1: set idle_after",
        "model 'b': min_replicas 2 exceeds replicas 1",
        "model 'c': a watched model is never scaled to zero unless its watch says allow_scale_to_zero: true",
        "model 'd': idle_after: not a duration",
        "model 'e': min_replicas",
    ]:
        assert fragment in text, fragment
    assert len(e.value.problems) == 5


def test_watched_model_may_scale_to_zero_when_it_says_so() -> None:
    cat = parse_catalog(
        "models:\n  - {name: c, engine: sim, min_replicas: 0, idle_after: 10m,"
        " watch: {allow_scale_to_zero: true}}"
    )
    p = cat.get("c")
    assert p is not None and p.watch is not None and p.watch.allow_scale_to_zero


def test_watched_model_may_scale_down_to_one_without_opting_in() -> None:
    cat = parse_catalog(
        "models:\n  - {name: c, engine: sim, replicas: 3, min_replicas: 1, idle_after: 1h, watch: {}}"
    )
    assert cat.get("c") is not None


@pytest.mark.parametrize("idle_after", ["0", "0s", "0m", "0ms"])
def test_idle_after_zero_is_refused_with_the_other_problems(idle_after: str) -> None:
    # idle_after 0 would stop a replica the moment any router knows it idle for 0s: one just used.
    bad = (
        "models:\n"
        f"  - {{name: a, engine: sim, replicas: 2, min_replicas: 0, idle_after: '{idle_after}'}}\n"
        "  - {name: b, engine: sim, replicas: 1, min_replicas: 2}\n"
    )
    with pytest.raises(CatalogError) as e:
        parse_catalog(bad)
    text = "\n".join(e.value.problems)
    assert "model 'a': idle_after must be more than 0" in text
    assert "model 'b': min_replicas 2 exceeds replicas 1" in text
    assert len(e.value.problems) == 2


def test_failover_on_a_llama_server_that_cannot_continue_an_answer_is_refused() -> None:
    # llama.cpp continues a final assistant message unless told not to prefill it: a continuation would
    # then start a new answer after the partial one, and the client would read both.
    bad = """
models:
  - {name: a, engine: llamacpp, args: [--ctx-size, "2048", --no-prefill-assistant]}
  - {name: b, engine: llamacpp, env: {LLAMA_ARG_NO_PREFILL_ASSISTANT: "1"}}
  - {name: c, engine: sim, replicas: 1, min_replicas: 2}
"""
    with pytest.raises(CatalogError) as e:
        parse_catalog(bad)
    text = "\n".join(e.value.problems)
    for fragment in [
        "model 'a': failover continues an answer as a final assistant message, which --no-prefill-assistant",
        "model 'b': failover continues an answer as a final assistant message, which "
        "LLAMA_ARG_NO_PREFILL_ASSISTANT",
        "model 'c': min_replicas 2 exceeds replicas 1",
    ]:
        assert fragment in text, (fragment, text)
    assert len(e.value.problems) == 3
    # Said so: no failover, and the flag is fine.
    ok = parse_catalog(
        "models:\n  - {name: a, engine: llamacpp, failover: false, args: [--no-prefill-assistant]}"
    )
    assert ok.get("a") is not None


def test_cache_routing_defaults_by_engine_and_events_on_llama_cpp_is_refused() -> None:
    from llmgw_common.catalog import CacheRouting

    cat = parse_catalog(
        """
models:
  - {name: v, engine: vllm, gpu_class: H100-80GB}
  - {name: s, engine: sim}
  - {name: l, engine: llamacpp}
  - {name: o, engine: sim, cache_routing: off}
"""
    )
    modes = {p.name: p.cache_routing_mode for p in cat.models}
    assert modes == {
        "v": CacheRouting.EVENTS,
        "s": CacheRouting.EVENTS,
        "l": CacheRouting.APPROXIMATE,
        "o": CacheRouting.OFF,
    }
    with pytest.raises(CatalogError) as e:
        parse_catalog("models:\n  - {name: l, engine: llamacpp, cache_routing: events}\n")
    assert "llama.cpp publishes none: use approximate" in "\n".join(e.value.problems)
    with pytest.raises(CatalogError):
        parse_catalog("models:\n  - {name: s, engine: sim, cache_routing: exact}\n")
