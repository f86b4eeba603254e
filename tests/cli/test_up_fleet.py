"""The fleet file of `llmgw up`: parsing, the errors an operator sees, and the agent settings it yields."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmgw_agent.settings import AgentSettings
from llmgw_cli.fleet import FleetError, load_fleet_file, parse_fleet, parse_gpu_spec
from llmgw_common.catalog import load_catalog_file

REPO = Path(__file__).resolve().parents[2]


def problems_of(text: str) -> list[str]:
    with pytest.raises(FleetError) as ei:
        parse_fleet(text)
    return ei.value.problems


def test_gpu_spec_parses_count_and_class() -> None:
    assert parse_gpu_spec("8xH100-80GB") == (8, "H100-80GB")
    assert parse_gpu_spec(" 4 x A100-80GB ") == (4, "A100-80GB")


@pytest.mark.parametrize("spec", ["H100", "8H100", "x8", "eight x H100", "8x", "-1xH100"])
def test_bad_gpu_spec_names_the_expected_shape(spec: str) -> None:
    (p,) = problems_of(f"nodes: [{{name: n1, gpus: '{spec}'}}]")
    assert p.startswith("node 'n1': gpus: ")
    assert f"{spec!r}" in p and "'<count>x<CLASS>'" in p


def test_gpu_class_must_name_its_memory_as_the_agent_requires() -> None:
    (p,) = problems_of("nodes: [{name: n1, gpus: 1xL4}]")
    assert p == "node 'n1': gpus: GPU spec '1xL4': the class must end in its memory, e.g. 'L4-24GB'"


def test_gpu_spec_that_is_not_a_string_is_refused() -> None:
    (p,) = problems_of("nodes: [{name: n1, gpus: 8}]")
    assert "node 'n1': gpus:" in p and "<count>x<CLASS>" in p


def test_unknown_fields_are_named_at_every_level() -> None:
    probs = problems_of("nodes: [{name: n1, gpu: 8xH100-80GB}]\nnode: []\n")
    assert "unknown top-level field 'node' (known: nodes)" in probs
    assert "node 'n1': gpu: unknown field" in probs


def test_every_problem_is_listed_in_one_round() -> None:
    probs = problems_of(
        """
nodes:
  - {name: a, gpus: 2xH100-80GB, unhealthy: {5: XID 79}}
  - {name: a}
  - {name: 'bad.name'}
  - {name: c, memory_gb: 0}
  - {gpus: 1xL4-24GB}
  - {name: local}
"""
    )
    assert "node 'a': unhealthy GPU 5 does not exist (the node has GPUs 0-1)" in probs
    assert "node 'a': duplicate name (also nodes[0])" in probs
    assert any(p.startswith("node 'bad.name': node name 'bad.name' may contain only") for p in probs)
    assert any(p.startswith("node 'c': memory_gb:") for p in probs)
    assert "nodes[4]: name: Field required" in probs
    assert "node 'local': the name 'local' is taken by the real machine's agent" in probs
    assert len(probs) == 6


def test_unhealthy_gpu_on_a_node_without_gpus() -> None:
    (p,) = problems_of("nodes: [{name: n1, unhealthy: {0: dead}}]")
    assert p == "node 'n1': unhealthy GPU 0 does not exist (the node has no GPUs)"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("nodes: [a", "not valid YAML"),
        ("- a\n- b\n", "a fleet file is a mapping with a 'nodes' list"),
        ("nodes: {a: 1}", "'nodes' must be a list"),
        ("nodes: [{name: n1, fabric: 'ib a'}]", "node 'n1': fabric 'ib a' may contain only"),
    ],
)
def test_shape_errors(text: str, problem: str) -> None:
    probs = problems_of(text)
    assert any(p.startswith(problem) for p in probs), probs


def test_empty_file_is_an_empty_fleet() -> None:
    assert parse_fleet("").nodes == ()


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FleetError) as ei:
        load_fleet_file(str(tmp_path / "nope.yaml"))
    assert ei.value.problems == [f"cannot read {tmp_path / 'nope.yaml'}: No such file or directory"]


def test_agent_env_is_read_back_by_agent_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    (node,) = parse_fleet(
        """
nodes:
  - name: gpu-b1
    fabric: ib-b
    gpus: 4 x A100-80GB
    unhealthy: {3: XID 79 seen}
    memory_gb: 1024
    labels: {role: coding}
"""
    ).nodes
    for k in list(os.environ):
        if k.startswith("LLMGW_"):
            monkeypatch.delenv(k)
    for k, v in node.agent_env().items():
        monkeypatch.setenv(k, v)
    s = AgentSettings()
    assert s.node == "gpu-b1"
    assert s.fabric == "ib-b"
    assert s.sim_gpus == "4xA100-80GB"
    assert s.sim_unhealthy == {3: "XID 79 seen"}
    assert s.sim_memory_gb == 1024.0
    assert s.labels == {"role": "coding"}
    assert s.simulate_engines is True


def test_node_without_memory_reports_none() -> None:
    (node,) = parse_fleet("nodes: [{name: n1, gpus: 1xL4-24GB}]").nodes
    env = node.agent_env()
    assert "LLMGW_SIM_MEMORY_GB" not in env
    assert json.loads(json.dumps(env))["LLMGW_SIM_GPUS"] == "1xL4-24GB"


def test_example_fleet_has_what_the_issue_asks() -> None:
    fleet = load_fleet_file(str(REPO / "examples" / "fleet.yaml"))
    assert 3 <= len(fleet.nodes) <= 4
    assert len({n.fabric for n in fleet.nodes}) >= 2
    assert len({n.gpu_class for n in fleet.nodes if n.gpu_class}) >= 2
    assert any(n.unhealthy for n in fleet.nodes)


def test_example_catalog_is_valid_and_fast() -> None:
    cat = load_catalog_file(str(REPO / "examples" / "catalog.yaml"))
    assert any(m.gpu_class is None for m in cat.models)
    assert any(m.watch is not None for m in cat.models)
    assert all(float(m.options.get("startup_s", 0)) <= 2 for m in cat.models)
