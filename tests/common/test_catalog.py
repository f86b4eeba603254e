from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_common.catalog import (
    Catalog,
    CatalogError,
    ModelProfile,
    catalog_to_yaml,
    load_catalog_file,
    parse_catalog,
)

GOOD = """
models:
  - name: llama-3.1-8b
    engine: vllm
    gpu_class: H100-80GB
    replicas: 2
  - name: tiny
    engine: llamacpp
  - name: judge
    engine: sim
    watch: {probe_every: 30s, budget: 20s, failures: 3}
"""


def _profile(cat: Catalog, name: str) -> ModelProfile:
    p = cat.get(name)
    assert p is not None, f"{name} is not in the catalog"
    return p


def test_valid_catalog_parses_and_round_trips() -> None:
    cat = parse_catalog(GOOD)
    assert cat.names == ("llama-3.1-8b", "tiny", "judge")
    assert _profile(cat, "llama-3.1-8b").gpus == 1
    assert _profile(cat, "tiny").gpus == 0
    watch = _profile(cat, "judge").watch
    assert watch is not None and watch.probe_every == 30.0
    assert parse_catalog(catalog_to_yaml(cat)) == cat


def test_every_problem_is_listed_at_once() -> None:
    bad = """
models:
  - {name: a, engine: nope}
  - {name: b, engine: vllm}
  - {name: c, engine: llamacpp, nodes: 2}
  - {name: d, engine: llamacpp, gpu_class: L4-24GB, gpus_per_node: 2}
  - {name: e, engine: sim, replicas: -1}
  - {name: f, engine: sim, colour: blue}
  - {name: g, engine: sim}
  - {name: g, engine: sim}
"""
    with pytest.raises(CatalogError) as e:
        parse_catalog(bad)
    text = "\n".join(e.value.problems)
    for fragment in [
        "model 'a': unknown engine 'nope'",
        "model 'b': engine vllm needs a GPU",
        "model 'c': engine llamacpp cannot span nodes",
        "model 'd': engine llamacpp has no tensor parallelism",
        "model 'e': replicas",
        "model 'f': colour: unknown field",
        "model 'g': duplicate name",
    ]:
        assert fragment in text, fragment
    assert len(e.value.problems) == 7


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("models: [", "not valid YAML"),
        ("- a\n- b", "a catalog is a mapping"),
        ("models: 3", "'models' must be a list"),
        ("modles: []", "unknown top-level field 'modles'"),
        ("models:\n  - {name: w, engine: sim, watch: {probe_every: 5s, budget: 10s}}", "exceeds probe_every"),
        ("models:\n  - {name: w, engine: sim, watch: {probe_every: soon}}", "not a duration"),
    ],
)
def test_refusals_say_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(CatalogError) as e:
        parse_catalog(text)
    assert fragment in str(e.value)


def test_missing_file_is_a_catalog_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog_file(str(tmp_path / "none.yaml"))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_parses_or_raises_catalog_error(text: str) -> None:
    try:
        parse_catalog(text)
    except CatalogError:
        pass


_val = st.one_of(
    st.none(),
    st.integers(-3, 5),
    st.text(max_size=6),
    st.booleans(),
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "name",
                    "engine",
                    "replicas",
                    "gpu_class",
                    "gpus_per_node",
                    "nodes",
                    "min_memory_gb",
                    "watch",
                    "bogus",
                ]
            ),
            _val,
            max_size=6,
        ),
        max_size=4,
    )
)
@pytest.mark.slow
def test_any_structure_parses_or_raises_catalog_error(models: list[object]) -> None:
    try:
        parse_catalog({"models": models})
    except CatalogError as e:
        assert e.problems


@pytest.mark.parametrize(
    ("field", "fragment"),
    [
        ("options: {tokens_per_s: .nan}", "options.tokens_per_s: not a finite number (nan)"),
        ("options: {timing: {ttft_ms: [1, .inf]}}", "options.timing.ttft_ms[1]: not a finite number (inf)"),
        ("startup_timeout_s: .inf", "startup_timeout_s"),
        ("queue_timeout_s: .nan", "queue_timeout_s"),
        ("min_memory_gb: .inf", "min_memory_gb"),
        ("wake_timeout_s: .inf", "wake_timeout_s"),
        ("wake_timeout_s: 0", "wake_timeout_s"),
    ],
)
def test_non_finite_numbers_are_refused(field: str, fragment: str) -> None:
    """NaN never equals itself: a replica's spec with one would never match its profile again, so the
    model would roll at every control-plane restart; and an infinite timeout is no timeout."""
    text = f"models:\n  - name: m\n    engine: sim\n    {field}\n"
    with pytest.raises(CatalogError) as e:
        parse_catalog(text)
    assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("line", "expected"), [("", True), ("failover: false", False), ("failover: true", True)], ids=str
)
def test_failover_is_on_unless_turned_off(line: str, expected: bool) -> None:
    cat = parse_catalog(f"models:\n  - name: m\n    engine: sim\n    {line}\n")
    assert _profile(cat, "m").failover is expected
    assert parse_catalog(catalog_to_yaml(cat)) == cat


def test_failover_must_be_a_boolean() -> None:
    with pytest.raises(CatalogError) as e:
        parse_catalog("models:\n  - name: m\n    engine: sim\n    failover: maybe\n")
    assert "failover" in str(e.value)


def test_wake_timeout_is_the_start_bound_unless_set() -> None:
    """A cold model may be held as long as its engine may take to start, or its own bound."""
    m = parse_catalog("models:\n  - name: m\n    engine: sim\n    startup_timeout_s: 90\n").models[0]
    assert (m.wake_timeout_s, m.wake_timeout) == (None, 90.0)
    m = parse_catalog(
        "models:\n  - {name: m, engine: sim, startup_timeout_s: 90, wake_timeout_s: 20}\n"
    ).models[0]
    assert m.wake_timeout == 20.0
