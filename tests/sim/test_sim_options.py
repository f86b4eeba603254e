"""SimOptions from catalog mappings and flags, the CLI's parsing, metrics text and leader membership."""

from __future__ import annotations

import json
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from llmgw_cli import cmd_sim_engine
from llmgw_sim.cluster import HEARTBEAT_MISSES, Membership
from llmgw_sim.metrics import LoadSnapshot, render
from llmgw_sim.options import SimOptions


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """A group, so that `sim-engine` is a subcommand as in `llmgw`."""

    cmd_sim_engine.register(app)
    return app


def test_from_dict_takes_catalog_options_and_coerces() -> None:
    o = SimOptions.from_dict(
        {"ttft_ms": 50, "tokens_per_s": "80", "slots": 8, "startup_s": 1.5, "fail_health": "yes", "zero": 0}
    )
    assert (o.ttft_ms, o.tokens_per_s, o.slots, o.startup_s) == (50.0, 80.0, 8, 1.5)
    assert o.fail_health is True and o.zero is False
    assert isinstance(o.ttft_ms, float) and isinstance(o.slots, int)
    assert SimOptions.from_dict({"exit_after": None}).exit_after is None
    assert SimOptions.from_dict({}) == SimOptions()


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"ttft": 5}, "unknown option(s) ttft"),
        ({"slots": 2.5}, "slots is 2.5, expected int"),
        ({"slots": True}, "slots is True, expected int"),
        ({"tokens_per_s": "fast"}, "tokens_per_s is 'fast', expected float"),
        ({"fail_health": "maybe"}, "fail_health is 'maybe', expected bool"),
        ({"model": None}, "model cannot be empty"),
        ({"metrics_style": "tgi"}, "metrics_style is 'tgi'"),
        ({"slots": 0}, "slots is 0, must be >= 1"),
        ({"tokens_per_s": 0}, "tokens_per_s is 0.0, must be > 0"),
        ({"ttft_ms": -1}, "ttft_ms is -1.0"),
        ({"startup_s": -1}, "startup_s is -1.0"),
        ({"kv_tokens": 0}, "kv_tokens is 0"),
        ({"exit_after": 0}, "exit_after is 0"),
        ({"world": 0}, "world is 0"),
        ({"rank": 2, "world": 2, "leader": "h:1"}, "rank 2 is outside 0..1"),
        ({"rank": 1, "world": 2}, "needs the leader's host:port"),
        ({"rank": 1, "world": 2, "leader": "nohost"}, "leader 'nohost' is not host:port"),
        ({"port": 70000}, "port 70000 is outside"),
        ({"embedding_dims": 0}, "embedding_dims is 0"),
        ({"default_max_tokens": 0}, "default_max_tokens is 0"),
        ({"heartbeat_s": 0}, "heartbeat_s is 0.0"),
        ({"runner": "chat"}, "runner is 'chat', must be one of generate, pooling"),
        ({"pooling_task": "rank"}, "pooling_task is 'rank'"),
        ({"num_labels": 0}, "num_labels is 0"),
        ({"responses_store": -1}, "responses_store is -1"),
        ({"max_model_len": 0}, "max_model_len is 0"),
    ],
)
def test_bad_options_name_what_is_wrong(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as ei:
        SimOptions.from_dict(options)
    assert needle in str(ei.value)


def test_to_argv_round_trips_through_the_cli(cli: typer.Typer) -> None:
    opts = SimOptions(
        port=12345,
        host="0.0.0.0",
        model="m-1",
        metrics_style="llamacpp",
        ttft_ms=12.5,
        tokens_per_s=80,
        slots=3,
        kv_tokens=4096,
        startup_s=2,
        fail_health=True,
        exit_after=7,
        rank=1,
        world=3,
        leader="10.0.0.1:9000",
        embedding_dims=16,
        zero=True,
        default_max_tokens=9,
        heartbeat_s=0.25,
        runner="pooling",
        pooling_task="classify",
        num_labels=3,
        transcription=True,
        responses_store=0,
        max_model_len=512,
    )
    argv = opts.to_argv()
    assert argv[:2] == ["--port", "12345"]
    assert "--fail-health" in argv and "--zero" in argv
    r = CliRunner().invoke(cli, ["sim-engine", *argv, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert SimOptions(**json.loads(r.stdout)) == opts
    # Defaults round-trip too, and leave flags that are off or unset out.
    d = SimOptions().to_argv()
    assert "--fail-health" not in d and "--exit-after" not in d and "--leader" not in d
    r = CliRunner().invoke(cli, ["sim-engine", *d, "--dry-run"])
    assert SimOptions(**json.loads(r.stdout)) == SimOptions()


def test_api_surface_options_go_on_the_command_line_only_when_set() -> None:
    plain = SimOptions().to_argv()
    assert not {"--runner", "--pooling-task", "--num-labels", "--transcription", "--responses-store"} & set(
        plain
    )
    assert "--max-model-len" not in plain
    o = SimOptions.from_dict(
        {"runner": "pooling", "pooling_task": "classify", "num_labels": "1", "transcription": "yes"}
    )
    argv = o.to_argv()
    assert argv[argv.index("--runner") + 1] == "pooling"
    assert argv[argv.index("--pooling-task") + 1] == "classify"
    assert argv[argv.index("--num-labels") + 1] == "1"
    assert "--transcription" in argv


@pytest.mark.parametrize(
    ("runner", "task", "labels", "serves"),
    [
        (None, "embed", 2, {"generate", "embed", "classify", "score", "audio"}),
        ("generate", "embed", 2, {"generate"}),
        ("pooling", "embed", 2, {"embed", "score"}),
        ("pooling", "classify", 2, {"classify"}),
        ("pooling", "classify", 1, {"classify", "score"}),
    ],
)
def test_what_each_runner_serves(runner: str | None, task: str, labels: int, serves: set[str]) -> None:
    o = SimOptions(runner=runner, pooling_task=task, num_labels=labels)
    got = {t for t in ("embed", "classify", "score") if o.pools_for(t)}
    got |= {"generate"} if o.generates else set()
    got |= {"audio"} if o.transcribes else set()
    assert got == serves
    assert SimOptions(runner="generate", transcription=True).transcribes


def test_command_runs_the_cli_module() -> None:
    cmd = SimOptions(port=1).command(python="/py")
    assert cmd[:4] == ["/py", "-m", "llmgw_cli", "sim-engine"]
    assert cmd[4:6] == ["--port", "1"]


def test_cli_refuses_bad_flags_with_exit_2(cli: typer.Typer) -> None:
    r = CliRunner().invoke(cli, ["sim-engine", "--metrics-style", "tgi", "--dry-run"])
    assert r.exit_code == 2
    assert "metrics_style is 'tgi'" in r.output


# ---------------------------------------------------------------- metrics text


SNAP = LoadSnapshot(
    running=2,
    waiting=3,
    slots=4,
    prompt_tokens_total=10,
    generation_tokens_total=40,
    requests_total=5,
    prompt_seconds_total=0.5,
    generation_seconds_total=2.0,
)


def test_vllm_metrics_names_labels_and_kv() -> None:
    text = render("vllm", SNAP, 'we"ird')
    lab = '{engine="0",model_name="we\\"ird"}'
    assert f"vllm:num_requests_running{lab} 2.0\n" in text
    assert f"vllm:num_requests_waiting{lab} 3.0\n" in text
    assert f"vllm:kv_cache_usage_perc{lab} 0.5\n" in text
    assert "# TYPE vllm:num_requests_running gauge" in text
    assert "llamacpp" not in text


def test_llamacpp_metrics_have_no_kv_and_no_labels() -> None:
    text = render("llamacpp", SNAP, "m")
    assert "llamacpp:requests_processing 2.0\n" in text
    assert "llamacpp:requests_deferred 3.0\n" in text
    assert "llamacpp:predicted_tokens_seconds 20.0\n" in text
    assert "kv" not in text
    assert "vllm" not in text and "{" not in text


def test_kv_usage_by_tokens_when_capacity_is_given() -> None:
    snap = LoadSnapshot(1, 0, 4, 0, 0, 0, 0.0, 0.0, kv_tokens_used=300, kv_tokens=1000)
    assert snap.kv_usage == 0.3
    over = LoadSnapshot(1, 0, 4, 0, 0, 0, 0.0, 0.0, kv_tokens_used=3000, kv_tokens=1000)
    assert over.kv_usage == 1.0


def test_kv_usage_of_idle_engine_is_zero() -> None:
    idle = LoadSnapshot(0, 0, 4, 0, 0, 0, 0.0, 0.0)
    assert idle.kv_usage == 0.0
    assert "llamacpp:predicted_tokens_seconds 0.0" in render("llamacpp", idle, "m")


# ---------------------------------------------------------------- leader membership


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_membership_whole_only_with_every_follower_beating() -> None:
    clock = FakeClock()
    m = Membership(world=3, heartbeat_s=0.5, clock=clock)
    assert m.missing() == [1, 2]
    assert m.join({"rank": 1, "world": 3, "instance": "a"}) is None
    assert m.missing() == [2]
    assert m.join({"rank": 2, "world": 3, "instance": "b"}) is None
    assert m.missing() == []
    # Rank 2 keeps beating; rank 1 goes silent past the timeout.
    clock.now += 0.5 * HEARTBEAT_MISSES - 0.1
    assert m.join({"rank": 2, "world": 3, "instance": "b"}) is None
    assert m.missing() == []
    clock.now += 0.2
    assert m.missing() == [1]
    # A restarted follower (new instance) rejoins.
    assert m.join({"rank": 1, "world": 3, "instance": "a2"}) is None
    assert m.missing() == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (None, "must be an object"),
        ({"rank": "1", "world": 2, "instance": "a"}, "integer rank"),
        ({"rank": 1, "world": 2}, "string instance"),
        ({"rank": 1, "world": 3, "instance": "a"}, "world 3, the leader has world 2"),
        ({"rank": 0, "world": 2, "instance": "a"}, "rank 0 is not a follower rank"),
        ({"rank": 2, "world": 2, "instance": "a"}, "rank 2 is not a follower rank"),
    ],
)
def test_membership_refuses_bad_joins(body: object, needle: str) -> None:
    m = Membership(world=2, heartbeat_s=0.5, clock=FakeClock())
    refused = m.join(body)
    assert refused is not None and needle in refused
    assert m.missing() == [1]
