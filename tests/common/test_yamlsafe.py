"""The bounded YAML loader, and that every reader of operator YAML goes through it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from llmgw_agent.settings import AgentSettings
from llmgw_cli.fleet import FleetError, parse_fleet
from llmgw_common.catalog import CatalogError, parse_catalog
from llmgw_common.yamlsafe import MAX_BYTES, YamlError, load_yaml
from llmgw_router.static import StaticConfigError, parse_static
from llmgw_runtime.settings import load_settings


def alias_bomb(levels: int = 9, fan: int = 10) -> str:
    """The "billion laughs": each anchor's value aliases the previous one ``fan`` times."""
    lines = ["a0: &a0 [lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]")
    return "\n".join(lines) + "\n"


def catalog_bomb() -> str:
    """The catalog of the report: the bomb sits in a model's ``options``."""
    body = alias_bomb().replace("\n", "\n      ")
    return f"models:\n  - name: tiny\n    engine: sim\n    options:\n      {body}\n"


def test_the_bomb_is_small() -> None:
    assert len(catalog_bomb()) < 1300


def test_alias_bomb_is_refused_fast_naming_the_problem() -> None:
    t0 = time.perf_counter()
    with pytest.raises(YamlError, match="expands to more than 200000 nodes"):
        load_yaml(alias_bomb())
    assert time.perf_counter() - t0 < 0.5


def test_catalog_with_an_alias_bomb_is_refused_fast() -> None:
    t0 = time.perf_counter()
    with pytest.raises(CatalogError, match="aliases are expanded") as ei:
        parse_catalog(catalog_bomb())
    assert time.perf_counter() - t0 < 0.5
    assert ei.value.problems[0].startswith("not valid YAML: ")


def test_ordinary_aliases_and_merge_keys_still_load() -> None:
    text = """
defaults: &d {engine: sim, replicas: 2}
models:
  - {<<: *d, name: a}
  - {<<: *d, name: b, replicas: 1}
"""
    data = load_yaml(text)
    assert data["models"] == [
        {"engine": "sim", "replicas": 2, "name": "a"},
        {"engine": "sim", "replicas": 1, "name": "b"},
    ]


def test_expansion_is_counted_per_use_not_per_anchor() -> None:
    doc = "a: &a [x, x, x]\nb: &b [*a, *a, *a]\n"
    # root map (1) + keys a, b (2) + a's list (4) + b's list (1 + 3*4) = 20
    assert load_yaml(doc, max_nodes=20) == {"a": ["x"] * 3, "b": [["x"] * 3] * 3}
    with pytest.raises(YamlError, match="more than 19 nodes"):
        load_yaml(doc, max_nodes=19)


def test_recursive_alias_is_refused() -> None:
    with pytest.raises(YamlError, match="recursive alias"):
        load_yaml("a: &a [1, *a]\n")


def test_oversized_document_is_refused_before_parsing() -> None:
    big = "x: " + "y" * MAX_BYTES + "\n"
    with pytest.raises(YamlError, match=f"larger than {MAX_BYTES} bytes"):
        load_yaml(big)
    with pytest.raises(YamlError, match="larger than 10 bytes"):
        load_yaml(b"x: 12345678901\n", max_bytes=10)


def test_a_file_object_is_read_only_up_to_the_limit(tmp_path: Path) -> None:
    p = tmp_path / "big.yaml"
    p.write_text("x: " + "y" * 100 + "\n")
    with p.open() as f, pytest.raises(YamlError, match="larger than 50 bytes"):
        load_yaml(f, max_bytes=50)
    with p.open() as f:
        assert load_yaml(f) == {"x": "y" * 100}


def test_deep_nesting_is_a_yaml_error_not_a_crash() -> None:
    with pytest.raises(yaml.YAMLError, match="nesting"):
        load_yaml("[" * 100_000 + "]" * 100_000)


def test_plain_yaml_still_loads() -> None:
    assert load_yaml("") is None
    assert load_yaml("a: 1\nb: [x, {c: d}]\n") == {"a": 1, "b": ["x", {"c": "d"}]}


def test_settings_file_with_an_alias_bomb_is_bad_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "settings.yaml"
    p.write_text("prefix: llmgw\nlabels:\n  " + alias_bomb().replace("\n", "\n  "))
    # Through the environment, so that monkeypatch takes it back (load_settings(cls, path) sets it).
    monkeypatch.setenv("LLMGW_CONFIG", str(p))
    t0 = time.perf_counter()
    with pytest.raises(ValidationError, match="aliases are expanded"):
        load_settings(AgentSettings)
    assert time.perf_counter() - t0 < 0.5


def test_fleet_file_with_an_alias_bomb_is_refused() -> None:
    body = alias_bomb().replace("\n", "\n    ")
    with pytest.raises(FleetError, match="aliases are expanded"):
        parse_fleet(f"nodes:\n  - name: n1\n    labels:\n    {body}")


def test_static_router_file_with_an_alias_bomb_is_refused() -> None:
    with pytest.raises(StaticConfigError, match="aliases are expanded"):
        parse_static("models: []\nkeys: []\nx:\n  " + alias_bomb().replace("\n", "\n  "))


def test_no_module_reads_yaml_around_the_bounded_loader() -> None:
    root = Path(__file__).resolve().parents[2]
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for top in ("libs", "services")
        for p in (root / top).rglob("*.py")
        if p.name != "yamlsafe.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "yaml.safe_load" in line or "yaml.load(" in line or "YamlConfigSettingsSource(" in line
    ]
    assert offenders == [], "read YAML with llmgw_common.yamlsafe.load_yaml"
