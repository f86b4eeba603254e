"""The supervisor with real child processes: ready, crash, startup failures, stop without orphans, ports."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from pathlib import Path

import pytest

from llmgw_agent.converge import assignment_fingerprint
from llmgw_agent.enginelogs import read_tail
from llmgw_agent.engines import LaunchSpec, launch_spec
from llmgw_agent.metrics import VLLM_METRICS
from llmgw_agent.settings import AgentSettings
from llmgw_agent.supervisor import Supervisor
from llmgw_common.messages import ShardState
from llmgw_runtime.runtime import cancel_and_wait
from tests.agent.agent_helpers import Recorder, alive, assignment, free_port, script_spec
from tests.kit.cancels import swallows_one_cancel

Fixture = tuple[Supervisor, Recorder]


@pytest.mark.slow
async def test_sim_engine_start_ready_stop(sup: Fixture, reap_groups: list[int]) -> None:
    s, rec = sup
    port = free_port()
    a = assignment(port, options={"ttft_ms": 1})
    spec = launch_spec(a, AgentSettings(node="n1"))
    assert isinstance(spec, LaunchSpec)
    await s.start(a, spec)
    sh = s.shards[("r1", 0)]
    assert sh.pid is not None
    reap_groups.append(sh.pid)
    await rec.wait(sh.key, ShardState.READY)
    assert [r.state for r in s.reports()] == [ShardState.READY]
    state = json.loads(s.state_path.read_text())
    assert [(e["replica_id"], e["pid"], e["port"]) for e in state["engines"]] == [("r1", sh.pid, port)]
    pid = sh.pid
    await s.stop(sh.key)
    assert rec.states(sh.key)[-2:] == [ShardState.STOPPING, ShardState.STOPPED]
    assert not alive(pid)
    assert s.shards == {}
    assert json.loads(s.state_path.read_text())["engines"] == []


@pytest.mark.slow
async def test_crash_after_ready_is_failed_with_last_50_lines(
    sup: Fixture, engine_script: Path, reap_groups: list[int]
) -> None:
    s, rec = sup
    port = free_port()
    await s.start(assignment(port), script_spec(engine_script, port, "--lines", "80", "--exit-after", "0.8"))
    sh = s.shards[("r1", 0)]
    reap_groups.append(sh.pgid or 0)
    await rec.wait(sh.key, ShardState.READY)
    await rec.wait(sh.key, ShardState.FAILED)
    assert sh.error == "exited with code 7"
    assert len(sh.log_tail) == 50
    assert sh.log_tail[-1] == "engine crashed"
    assert sh.log_tail[-2] == "listening"
    assert sh.log_tail[0] == "engine line 32"
    # A failed shard holds no process and is out of the state file.
    assert sh.pid is None
    assert json.loads(s.state_path.read_text())["engines"] == []
    assert [r.state for r in s.reports()] == [ShardState.FAILED]


async def test_exit_during_startup(sup: Fixture, engine_script: Path) -> None:
    s, rec = sup
    port = free_port()
    await s.start(assignment(port), script_spec(engine_script, port, "--exit-now", "2"))
    await rec.wait(("r1", 0), ShardState.FAILED)
    sh = s.shards[("r1", 0)]
    assert sh.error == "exited with code 2 during startup"
    assert sh.log_tail == ("fatal: cannot load model",)
    assert ShardState.READY not in rec.states(sh.key)


@pytest.mark.slow
async def test_not_healthy_within_startup_timeout_is_failed_and_killed(
    sup: Fixture, engine_script: Path, reap_groups: list[int]
) -> None:
    s, rec = sup
    port = free_port()
    # 3 s, not 1: the engine script is a Python process, and on a loaded box its start alone took over
    # a second (a full run failed with ConnectError where it means to see the engine's own 503).
    a = assignment(port, startup_timeout_s=3.0)
    await s.start(a, script_spec(engine_script, port, "--never-healthy"))
    sh = s.shards[("r1", 0)]
    pid = sh.pid
    assert pid is not None
    reap_groups.append(pid)
    await rec.wait(sh.key, ShardState.FAILED)
    assert sh.error == "not healthy after 3s (HTTP 503)"
    assert not alive(pid)


@pytest.mark.slow
async def test_health_failing_after_ready(sup: Fixture, engine_script: Path, reap_groups: list[int]) -> None:
    s, rec = sup
    port = free_port()
    await s.start(assignment(port), script_spec(engine_script, port, "--healthy-for", "1.0"))
    sh = s.shards[("r1", 0)]
    pid = sh.pid
    assert pid is not None
    reap_groups.append(pid)
    await rec.wait(sh.key, ShardState.READY)
    await rec.wait(sh.key, ShardState.FAILED)
    assert sh.error == "health check failed 3 times in a row (HTTP 503)"
    assert not alive(pid)


@pytest.mark.slow
async def test_stop_kills_the_whole_group_including_a_grandchild_ignoring_sigterm(
    sup: Fixture, engine_script: Path, tmp_path: Path, reap_groups: list[int]
) -> None:
    s, rec = sup
    port = free_port()
    gc_file = tmp_path / "grandchild.pid"
    await s.start(assignment(port), script_spec(engine_script, port, "--grandchild", str(gc_file)))
    sh = s.shards[("r1", 0)]
    pid = sh.pid
    assert pid is not None
    reap_groups.append(pid)
    await rec.wait(sh.key, ShardState.READY)
    grandchild = int(gc_file.read_text())
    assert alive(grandchild)
    await s.stop(sh.key)
    assert not alive(pid)
    assert not alive(grandchild)


@pytest.mark.slow
async def test_crash_leaves_no_orphan_grandchild(
    sup: Fixture, engine_script: Path, tmp_path: Path, reap_groups: list[int]
) -> None:
    s, rec = sup
    port = free_port()
    gc_file = tmp_path / "grandchild.pid"
    spec = script_spec(engine_script, port, "--grandchild", str(gc_file), "--exit-after", "0.8")
    await s.start(assignment(port), spec)
    sh = s.shards[("r1", 0)]
    reap_groups.append(sh.pgid or 0)
    await rec.wait(sh.key, ShardState.FAILED)
    assert not alive(int(gc_file.read_text()))


async def test_port_in_use_is_failed_without_starting(sup: Fixture, engine_script: Path) -> None:
    s, rec = sup
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        await s.start(assignment(port), script_spec(engine_script, port))
    sh = s.shards[("r1", 0)]
    assert rec.states(sh.key) == [ShardState.FAILED]
    assert sh.error == f"port {port} already in use"
    assert sh.pid is None


async def test_missing_binary_is_failed(sup: Fixture) -> None:
    s, rec = sup
    port = free_port()
    spec = LaunchSpec(
        argv=("/no/such/llama-server", "--port", str(port)),
        env={},
        health_url=None,
        metrics_url=None,
        metrics=VLLM_METRICS,
    )
    await s.start(assignment(port), spec)
    sh = s.shards[("r1", 0)]
    assert rec.states(sh.key) == [ShardState.FAILED]
    assert sh.error is not None and sh.error.startswith("cannot start /no/such/llama-server")


async def test_readoption_by_a_new_supervisor(
    tmp_path: Path, engine_script: Path, reap_groups: list[int]
) -> None:
    rec1 = Recorder()
    s1 = Supervisor(tmp_path / "state", rec1, stop_grace_s=0.5, health_interval_s=0.2)
    port = free_port()
    a = assignment(port)
    spec = script_spec(engine_script, port)
    await s1.start(a, spec)
    sh1 = s1.shards[a.replica_id, a.shard]
    pid = sh1.pid
    assert pid is not None
    reap_groups.append(pid)
    await rec1.wait(sh1.key, ShardState.READY)
    # The agent dies without stopping anything: the monitor goes, the engine stays.
    await s1.aclose()
    assert alive(pid)

    rec2 = Recorder()
    s2 = Supervisor(tmp_path / "state", rec2, stop_grace_s=0.5, health_interval_s=0.2)
    try:
        records = s2.load_state()
        assert [(r.pid, r.fingerprint, r.argv_hash) for r in records] == [
            (pid, assignment_fingerprint(a), spec.argv_hash)
        ]
        await s2.adopt(records[0], a, spec)
        # It answered at adoption: reported ready as it was, never "starting" (that would take its
        # endpoint from the routers until the next health check).
        assert rec2.states(sh1.key) == [ShardState.READY]
        assert s2.shards[sh1.key].pid == pid
        await s2.stop(sh1.key)
        assert not alive(pid)
        # Stopped: a third run finds nothing to adopt.
        assert s2.load_state() == []
    finally:
        await s2.stop_all()
        await s2.aclose()


@pytest.mark.slow
async def test_recycled_pid_is_not_adopted_and_adopted_exit_is_failure(
    tmp_path: Path, engine_script: Path, reap_groups: list[int]
) -> None:
    rec = Recorder()
    s1 = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5, health_interval_s=0.2)
    port = free_port()
    a = assignment(port)
    spec = script_spec(engine_script, port, "--exit-after", "1.5")
    await s1.start(a, spec)
    pid = s1.shards[a.replica_id, a.shard].pid
    assert pid is not None
    reap_groups.append(pid)
    await rec.wait((a.replica_id, a.shard), ShardState.READY)
    await s1.aclose()
    # Same PID with another start time is someone else's process.
    raw = json.loads(s1.state_path.read_text())
    good = dict(raw["engines"][0])
    raw["engines"].append({**good, "replica_id": "r2", "create_time": good["create_time"] - 100})
    s1.state_path.write_text(json.dumps(raw))
    s2 = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5, health_interval_s=0.2)
    try:
        records = s2.load_state()
        assert [r.replica_id for r in records] == ["r1"]
        await s2.adopt(records[0], a, spec)
        await rec.wait((a.replica_id, a.shard), ShardState.FAILED)
        assert s2.shards[a.replica_id, a.shard].error == (
            "exited (exit status unknown: adopted after an agent restart)"
        )
    finally:
        await s2.stop_all()
        await s2.aclose()


@pytest.mark.slow
async def test_adopted_engine_that_does_not_answer_is_starting_and_judged_as_a_new_one(
    tmp_path: Path, engine_script: Path, reap_groups: list[int]
) -> None:
    rec = Recorder()
    port = free_port()
    a = assignment(port, startup_timeout_s=1.0)
    spec = script_spec(engine_script, port, "--never-healthy")
    s1 = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5, health_interval_s=0.2)
    await s1.start(a, spec)
    pid = s1.shards[a.replica_id, a.shard].pid
    assert pid is not None
    reap_groups.append(pid)
    await s1.aclose()  # the agent dies while its engine is still starting
    s2 = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5, health_interval_s=0.2)
    try:
        (record,) = s2.load_state()
        before = len(rec.events)
        await s2.adopt(record, a, spec)
        await rec.wait((a.replica_id, a.shard), ShardState.FAILED)
        assert [s for _, s, _ in rec.events[before:]] == [ShardState.STARTING, ShardState.FAILED]
        error = s2.shards[a.replica_id, a.shard].error
        assert error is not None and error.startswith("not healthy after 1s"), error
        assert not alive(pid)
    finally:
        await s2.stop_all()
        await s2.aclose()


@pytest.mark.parametrize(("age_s", "states"), [(5.0, ["ready"]), (0.2, ["starting", "ready"])])
@pytest.mark.slow
async def test_adopted_headless_engine_is_ready_once_past_its_settle_time(
    tmp_path: Path, engine_script: Path, reap_groups: list[int], age_s: float, states: list[str]
) -> None:
    """A headless engine (a multi-node follower) has no health check: alive past the settle time is ready."""
    rec = Recorder()
    port = free_port()
    a = assignment(port)
    spec = dataclasses.replace(script_spec(engine_script, port), health_url=None, metrics_url=None)
    s1 = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5, headless_settle_s=1.0, clock=lambda: 1000.0)
    await s1.start(a, spec)
    pid = s1.shards[a.replica_id, a.shard].pid
    assert pid is not None
    reap_groups.append(pid)
    await s1.aclose()
    s2 = Supervisor(
        tmp_path / "state", rec, stop_grace_s=0.5, headless_settle_s=1.0, clock=lambda: 1000.0 + age_s
    )
    try:
        (record,) = s2.load_state()
        before = len(rec.events)
        await s2.adopt(record, a, spec)
        await rec.wait((a.replica_id, a.shard), ShardState.READY)
        assert [s.value for _, s, _ in rec.events[before:]] == states
    finally:
        await s2.stop_all()
        await s2.aclose()


@pytest.mark.parametrize("content", ["not json", '{"engines": [{"pid": 1}]}', "[]"])
def test_unreadable_state_file_is_ignored(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def noop(_: object) -> None:
        return None

    s = Supervisor(tmp_path, noop)
    s.state_path.write_text(content)
    assert s.load_state() == []
    assert "ignoring unreadable state file" in caplog.text


def test_read_tail(tmp_path: Path) -> None:
    p = tmp_path / "x.log"
    p.write_text("".join(f"l{i}\n" for i in range(200)))
    assert read_tail(p) == tuple(f"l{i}" for i in range(150, 200))
    assert read_tail(tmp_path / "absent.log") == ()
    p.write_text("x" * 5000 + "\nshort\n")
    assert read_tail(p) == ("x" * 1000 + " …", "short")


async def test_unwritable_log_is_failed_with_the_path(tmp_path: Path, engine_script: Path) -> None:
    rec = Recorder()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "logs").write_text("a file where the log directory should be")
    s = Supervisor(tmp_path / "state", rec)
    try:
        port = free_port()
        await s.start(assignment(port), script_spec(engine_script, port))
        sh = s.shards[("r1", 0)]
        assert rec.states(sh.key) == [ShardState.FAILED]
        assert sh.error is not None and sh.error.startswith("cannot write engine log")
        assert sh.pid is None
    finally:
        await s.aclose()


async def test_unwritable_state_file_still_supervises(
    tmp_path: Path, engine_script: Path, caplog: pytest.LogCaptureFixture, reap_groups: list[int]
) -> None:
    rec = Recorder()
    (tmp_path / "state" / "engines.tmp").mkdir(parents=True)
    s = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5)
    try:
        port = free_port()
        await s.start(assignment(port), script_spec(engine_script, port))
        sh = s.shards[("r1", 0)]
        reap_groups.append(sh.pgid or 0)
        await rec.wait(sh.key, ShardState.READY)
        assert "cannot write state file" in caplog.text
        assert not s.state_path.exists()
    finally:
        await s.stop_all()
        await s.aclose()


def test_engines_do_not_inherit_the_agents_bus_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmgw_agent.procgroups import engine_environ

    monkeypatch.setenv("LLMGW_NATS_PASSWORD", "s3cret")
    monkeypatch.setenv("LLMGW_NATS_TOKEN", "t0ken")
    monkeypatch.setenv("LLMGW_UP_RUN", "run-1")
    env = engine_environ()
    assert "LLMGW_NATS_PASSWORD" not in env and "LLMGW_NATS_TOKEN" not in env
    assert env["LLMGW_UP_RUN"] == "run-1"  # the run marker `llmgw up` sweeps by stays


@pytest.mark.slow
async def test_stop_ends_a_monitor_that_swallowed_a_cancel(sup: Fixture, reap_groups: list[int]) -> None:
    """A monitor's state report is a nats publish, which drops a cancel when it has to wait (nats-py's
    _flush_pending swallows CancelledError; its forced flush uses 3.11's wait_for, CPython gh-86296): a
    stop that cancelled the monitor once then waited for it for ever, and the engine was never stopped."""
    s, rec = sup
    a = assignment(free_port(), options={"ttft_ms": 1})
    spec = launch_spec(a, AgentSettings(node="n1"))
    assert isinstance(spec, LaunchSpec)
    await s.start(a, spec)
    sh = s.shards[("r1", 0)]
    assert sh.pid is not None
    reap_groups.append(sh.pid)
    await rec.wait(sh.key, ShardState.READY)

    real = sh.task
    assert real is not None
    real.cancel()
    await asyncio.gather(real, return_exceptions=True)
    stubborn = sh.task = asyncio.create_task(swallows_one_cancel())
    await asyncio.sleep(0)
    stopping = asyncio.create_task(s.stop(sh.key))
    try:
        # Not wait_for: it would cancel stop(), whose own suppress would swallow that cancel too.
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert stopping in done and stubborn.done()
        assert not alive(sh.pid)
    finally:
        # Not one cancel each: the stand-in drops its first, and a failed check would then hang.
        await cancel_and_wait([stopping, stubborn], again_s=0.05)
