"""The adapters' KV-event wiring: vLLM's flags and environment, the simulator's endpoint, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw_agent.engines import (
    KV_TOPIC,
    MAX_IPC_PATH,
    KvSource,
    LaunchSpec,
    Refusal,
    kv_socket_path,
    launch_spec,
)
from llmgw_agent.settings import AgentSettings
from llmgw_common.messages import ShardAssignment
from llmgw_common.sim_options import SimOptions


def shard(**kw: Any) -> ShardAssignment:
    base: dict[str, Any] = dict(replica_id="r1", shard=0, model="m", engine="vllm", port=20001, gpus=(0,))
    base.update(kw)
    return ShardAssignment(**base)


def settings(tmp_path: Path, **kw: Any) -> AgentSettings:
    return AgentSettings(node="n1", vllm="vllm", state_dir=str(tmp_path / "state"), **kw)


def spec_of(a: ShardAssignment, s: AgentSettings) -> LaunchSpec:
    r = launch_spec(a, s)
    assert isinstance(r, LaunchSpec), r
    return r


def kv_config(argv: tuple[str, ...]) -> dict[str, Any]:
    assert argv.count("--kv-events-config") == 1, argv
    cfg: dict[str, Any] = json.loads(argv[argv.index("--kv-events-config") + 1])
    return cfg


def test_vllm_publishes_on_ipc_in_the_run_directory(tmp_path: Path) -> None:
    s = settings(tmp_path)
    spec = spec_of(shard(args=("--max-model-len", "512")), s)
    sock = tmp_path / "state" / "run" / "r1-0" / "kv.sock"
    replay = f"ipc://{sock.parent / 'kv-replay.sock'}"
    cfg = kv_config(spec.argv)
    assert cfg == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{sock}",
        "replay_endpoint": replay,
        "topic": KV_TOPIC,
    }
    # vLLM's own default where the model supports it; forced, it "may crash" the others.
    assert "--enable-prefix-caching" not in spec.argv
    assert spec.argv[-2:] == ("--max-model-len", "512")  # the profile's args stay last
    assert spec.env["PYTHONHASHSEED"] == "0"
    assert spec.kv_events == KvSource(f"ipc://{sock}", KV_TOPIC, 16, replay)
    assert sock.parent.is_dir()  # the engine binds there; nothing else makes the directory


def test_vllm_on_cpu_has_blocks_of_128_and_a_profile_block_size_wins(tmp_path: Path) -> None:
    s = settings(tmp_path)
    cpu = spec_of(shard(gpus=(), options={"device": "cpu"}), s)
    assert cpu.kv_events is not None and cpu.kv_events.block_size == 128
    given = spec_of(shard(args=("--block-size=32",)), s)
    assert given.kv_events is not None and given.kv_events.block_size == 32


def test_the_profiles_own_settings_are_not_duplicated(tmp_path: Path) -> None:
    own = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/x.sock"})
    spec = spec_of(
        shard(args=("--enable-prefix-caching", "--kv-events-config", own), env={"PYTHONHASHSEED": "7"}),
        settings(tmp_path),
    )
    assert (
        spec.argv.count("--enable-prefix-caching") == 1
        and kv_config(spec.argv)["endpoint"] == "ipc:///run/x.sock"
    )
    assert spec.env["PYTHONHASHSEED"] == "7"
    assert spec.kv_events == KvSource("ipc:///run/x.sock", "", 16)


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (
            ("--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}'),
            "not ipc://",
        ),
        (("--kv-events-config", '{"enable_kv_cache_events": false}'), "published over zmq"),
        (
            ("--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}'),
            "published over zmq",
        ),
        (("--kv-events-config", "{nope"), "not JSON"),
        (("--kv-events-config", "[1]"), "not a JSON object"),
        (("--no-enable-prefix-caching",), "prefix caching"),
        (("--block-size", "big"), "not a number"),
    ],
)
def test_contradicting_profile_args_are_refused(tmp_path: Path, args: tuple[str, ...], why: str) -> None:
    r = launch_spec(shard(args=args), settings(tmp_path))
    assert isinstance(r, Refusal) and why in r.reason, r


@pytest.mark.parametrize("args", [("--runner", "pooling"), ("--runner=pooling",), ("--convert", "embed")])
def test_a_pooling_runner_publishes_nothing(tmp_path: Path, args: tuple[str, ...]) -> None:
    spec = spec_of(shard(args=args), settings(tmp_path))
    assert (
        spec.kv_events is None and "--kv-events-config" not in spec.argv and "PYTHONHASHSEED" not in spec.env
    )


def test_a_follower_shard_publishes_nothing(tmp_path: Path) -> None:
    s = settings(tmp_path)
    follower = spec_of(shard(shard=1, shards=2, leader="10.0.0.1:20001"), s)
    assert follower.kv_events is None and "--kv-events-config" not in follower.argv
    assert "PYTHONHASHSEED" not in follower.env


def test_a_long_state_dir_moves_the_socket_where_its_path_fits(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    s = settings(deep)
    p = kv_socket_path(s, shard())
    assert len(str(p)) <= MAX_IPC_PATH and p.parent.is_dir()
    assert p == kv_socket_path(s, shard()) and p != kv_socket_path(s, shard(replica_id="r2"))


def test_a_state_dir_where_only_the_replay_socket_would_not_fit_moves_both(tmp_path: Path) -> None:
    # kv.sock's path 106 bytes (it fits), kv-replay.sock's 113 (it would not: vLLM would fail to start).
    pad = 106 - len(str(tmp_path)) - 1 - len("/state/run/r1-0/kv.sock")
    s = settings(tmp_path / ("p" * pad))
    assert len(str(tmp_path / ("p" * pad) / "state/run/r1-0/kv.sock")) == 106
    p = kv_socket_path(s, shard())
    replay = p.with_name(p.stem + "-replay.sock")
    assert len(str(replay)) <= MAX_IPC_PATH, replay
    spec = spec_of(shard(), s)
    assert spec.kv_events is not None and spec.kv_events.replay == f"ipc://{replay}"


def test_the_simulator_gets_the_same_endpoint(tmp_path: Path) -> None:
    s = settings(tmp_path)
    spec = spec_of(shard(engine="sim", gpus=(), options={"block_size": 8}), s)
    argv = spec.argv
    sock = tmp_path / "state" / "run" / "r1-0" / "kv.sock"
    assert argv[argv.index("--kv-events-endpoint") + 1] == f"ipc://{sock}"
    assert argv[argv.index("--kv-events-topic") + 1] == KV_TOPIC
    assert spec.kv_events == KvSource(f"ipc://{sock}", KV_TOPIC, 8)
    # A simulated vLLM on a simulated node too, with the simulator's default block size.
    sim_vllm = spec_of(shard(), settings(tmp_path, simulate_engines=True))
    assert sim_vllm.kv_events is not None and sim_vllm.kv_events.block_size == SimOptions().block_size
