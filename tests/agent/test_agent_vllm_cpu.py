"""vLLM on CPU: stated by ``options.device: cpu`` in the catalog, honoured by the agent's adapter.

Table-driven, no processes; the same argv against a real vLLM is tests/vllm.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw_agent.engines import LaunchSpec, Refusal, launch_spec, runs_api_server_module, vllm_command
from llmgw_agent.inventory import available_engines
from llmgw_agent.procgroups import engine_environ
from llmgw_agent.settings import AgentSettings
from llmgw_common.catalog import CatalogError, parse_catalog
from llmgw_common.messages import ShardAssignment

MODULE_CMD = f"{sys.executable} -m vllm.entrypoints.openai.api_server"


def shard(**kw: Any) -> ShardAssignment:
    base: dict[str, Any] = dict(replica_id="r1", shard=0, model="m", engine="vllm", port=20001)
    base.update(kw)
    return ShardAssignment(**base)


def settings(**kw: Any) -> AgentSettings:
    base: dict[str, Any] = dict(node="n1", vllm="vllm", llama_server="llama-server")
    base.update(kw)
    return AgentSettings(**base)


def cpu_shard(**kw: Any) -> ShardAssignment:
    return shard(options={"device": "cpu", **kw.pop("options", {})}, **kw)


def test_module_command_takes_the_model_as_an_option_and_runs_on_cpu() -> None:
    s = launch_spec(cpu_shard(args=("--max-model-len", "512")), settings(vllm=MODULE_CMD))
    assert isinstance(s, LaunchSpec), s
    assert s.argv[:5] == (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m")
    assert "serve" not in s.argv
    assert s.argv[s.argv.index("--tensor-parallel-size") + 1] == "1"
    assert s.argv[-2:] == ("--max-model-len", "512")
    assert s.env["VLLM_HOST_IP"] == "127.0.0.1" and s.env["CUDA_VISIBLE_DEVICES"] == ""
    assert s.unset == ("OMP_NUM_THREADS",)
    assert s.health_url == "http://127.0.0.1:20001/health"


def test_a_binary_still_runs_vllm_serve() -> None:
    s = launch_spec(cpu_shard(), settings(vllm="/opt/vllm/bin/vllm"))
    assert isinstance(s, LaunchSpec) and s.argv[:3] == ("/opt/vllm/bin/vllm", "serve", "m"), s


def test_the_profile_keeps_its_own_host_ip_and_omp_threads() -> None:
    s = launch_spec(cpu_shard(env={"VLLM_HOST_IP": "10.1.2.3", "OMP_NUM_THREADS": "4"}), settings())
    assert isinstance(s, LaunchSpec), s
    assert s.env["VLLM_HOST_IP"] == "10.1.2.3" and s.env["OMP_NUM_THREADS"] == "4" and s.unset == ()


def test_a_gpu_vllm_shard_is_left_as_it_was() -> None:
    s = launch_spec(shard(gpus=(0,)), settings())
    assert isinstance(s, LaunchSpec) and s.unset == () and "VLLM_HOST_IP" not in s.env, s


@pytest.mark.parametrize(
    ("a", "s", "why"),
    [
        (shard(), settings(), "vLLM needs a GPU"),
        (shard(options={"device": "gpu"}), settings(), "vLLM needs a GPU"),
        (cpu_shard(shards=2, leader="h:1"), settings(), "vLLM on CPU runs on one node"),
        (
            shard(gpus=(0,), shard=1, shards=2, leader="h:1"),
            settings(vllm=MODULE_CMD),
            "only `vllm serve` does",
        ),
        (cpu_shard(), settings(vllm="vllm 'unclosed"), "does not parse"),
        (cpu_shard(), settings(vllm="  "), "is empty"),
    ],
)
def test_refusals(a: ShardAssignment, s: AgentSettings, why: str) -> None:
    r = launch_spec(a, s)
    assert isinstance(r, Refusal) and why in r.reason, r


def test_unset_variables_do_not_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "OMP_NUM_THREADS" in engine_environ()
    assert "OMP_NUM_THREADS" not in engine_environ(("OMP_NUM_THREADS",))


def test_the_supervisor_starts_the_engine_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment a child gets from engine_environ(unset), seen by the child itself."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('OMP_NUM_THREADS', 'unset'))"],
        env=engine_environ(("OMP_NUM_THREADS",)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "unset"


def test_vllm_command_resolves_its_program_or_says_none(tmp_path: Path) -> None:
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert vllm_command(f"{exe} -m vllm.entrypoints.openai.api_server") == (
        str(exe), "-m", "vllm.entrypoints.openai.api_server",
    )  # fmt: skip
    assert vllm_command(str(tmp_path / "absent")) is None
    assert vllm_command("a 'b") is None
    assert runs_api_server_module((str(exe), "-m", "vllm.entrypoints.openai.api_server"))
    assert not runs_api_server_module((str(exe), "serve"))


def test_a_cpu_node_offers_vllm_only_when_it_says_its_vllm_is_a_cpu_build(tmp_path: Path) -> None:
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    cmd = f"{exe} -m vllm.entrypoints.openai.api_server"
    missing = str(tmp_path / "no-llama")
    assert "vllm" not in available_engines(settings(vllm=cmd, llama_server=missing), (), simulated=False)
    on = available_engines(settings(vllm=cmd, vllm_cpu=True, llama_server=missing), (), simulated=False)
    assert on == ("sim", "vllm")
    absent = settings(vllm=str(tmp_path / "absent"), vllm_cpu=True, llama_server=missing)
    assert "vllm" not in available_engines(absent, (), simulated=False)


# ------------------------------------------------------------------ the catalog's statement


def _catalog(**model: Any) -> str:
    import yaml

    return yaml.safe_dump({"models": [{"name": "m", "engine": "vllm", **model}]})


def test_a_cpu_vllm_profile_is_accepted_and_reaches_the_agent_in_its_options() -> None:
    cat = parse_catalog(_catalog(options={"device": "cpu"}))
    p = cat.models[0]
    assert p.gpu_class is None and p.gpus == 0 and p.options["device"] == "cpu"


@pytest.mark.parametrize(
    ("model", "problems"),
    [
        ({}, ["engine vllm needs a GPU: set gpu_class (or options.device: cpu"]),
        ({"options": {"device": "cuda"}}, ["options.device must be cpu", "engine vllm needs a GPU"]),
        (
            {"options": {"device": "cpu"}, "gpu_class": "L4-24GB"},
            ["options.device cpu contradicts gpu_class L4-24GB"],
        ),
        ({"options": {"device": "cpu"}, "nodes": 2}, ["options.device cpu runs on one node (nodes=2)"]),
    ],
)
def test_cpu_statement_problems_are_all_listed(model: dict[str, Any], problems: list[str]) -> None:
    with pytest.raises(CatalogError) as e:
        parse_catalog(_catalog(**model))
    text = "\n".join(e.value.problems)
    for p in problems:
        assert p in text, text


def test_device_cpu_on_llamacpp_and_the_simulator_is_harmless() -> None:
    import yaml

    doc = {"models": [{"name": "a", "engine": "llamacpp", "options": {"device": "cpu"}}]}
    assert parse_catalog(yaml.safe_dump(doc)).models[0].options["device"] == "cpu"
    sim = parse_catalog(
        yaml.safe_dump({"models": [{"name": "s", "engine": "sim", "options": {"device": "cpu"}}]})
    )
    spec = launch_spec(shard(engine="sim", model="s", options=dict(sim.models[0].options)), settings())
    assert isinstance(spec, LaunchSpec) and "--device" not in spec.argv, spec
