"""The process handling of `llmgw up`, with real processes standing in for the services.

Stand-ins behave like the real ones where it matters: each records the SIGTERM it got, some start an
"engine" in its own session (as agents do) and leave it behind, one ignores SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llmgw_cli.devcluster import (
    RUN_MARKER,
    ChildSpec,
    Layout,
    Supervisor,
    child_env,
    is_run_entry_point,
    plan_children,
    run_processes,
)
from llmgw_cli.fleet import parse_fleet
from llmgw_cli.restarts import Restarts
from llmgw_cli.upkeep import supervise
from llmgw_cli.upready import wait_ready_then_serve
from llmgw_cli.upterm import StopFlag
from llmgw_common.catalog import Catalog
from llmgw_runtime.natsserver import NatsServer
from tests.kit.poll import eventually_sync

STANDIN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    name, rec = sys.argv[1], sys.argv[2]
    behave = os.environ.get("BEHAVE", "")
    def spawn_engine():
        e = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        return e.pid
    if "engine" in behave:
        pid = spawn_engine()
        open(f"{rec}.{name}.engine", "w").write(str(pid))
    if "detached" in behave:
        # Double fork: the engine is never a descendant of this process once the middle one exits.
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(r)
            os.write(w, str(spawn_engine()).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 64))
        os.wait()
        open(f"{rec}.{name}.engine", "w").write(str(pid))
    if "crash" in behave:
        print("boom: cannot bind", flush=True)
        sys.exit(3)
    def term(*_):
        with open(rec, "a") as f:
            f.write(name + "\\n")
        if "stubborn" not in behave:
            sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    open(f"{rec}.{name}.ready", "w").close()
    while True:
        time.sleep(0.2)
    """
)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def make_layout(tmp_path: Path) -> Layout:
    return Layout(
        data_dir=tmp_path,
        nats_url="nats://127.0.0.1:1",
        prefix="t",
        host="127.0.0.1",
        router_port=1,
        router_admin_port=2,
        controlplane_admin_port=3,
        catalog_file=tmp_path / "catalog.yaml",
        dev_key="k",
    )


@pytest.fixture
def rec(tmp_path: Path) -> Path:
    return tmp_path / "terms.txt"


@pytest.fixture
def sup(tmp_path: Path, rec: Path) -> Iterator[Supervisor]:
    def argv(spec: ChildSpec, _layout: Layout) -> list[str]:
        return [sys.executable, "-c", STANDIN, spec.name, str(rec)]

    s = Supervisor(make_layout(tmp_path), f"tok{os.getpid()}{time.monotonic_ns()}", argv_for=argv)
    yield s
    # Whatever a failing test left: never leave processes behind.
    s.stop_all()
    s.sweep()


def start_ready(sup: Supervisor, rec: Path, spec: ChildSpec) -> None:
    sup.start(spec)
    eventually_sync(lambda: Path(f"{rec}.{spec.name}.ready").exists(), what=f"{spec.name} to say it is ready")


@pytest.mark.slow
def test_stop_runs_in_reverse_tiers_and_leaves_no_engine(sup: Supervisor, rec: Path) -> None:
    start_ready(sup, rec, ChildSpec("cp", "x", {}, tier=0))
    start_ready(sup, rec, ChildSpec("router", "x", {}, tier=1))
    start_ready(sup, rec, ChildSpec("agent-a", "x", {"BEHAVE": "engine"}, tier=3))
    start_ready(sup, rec, ChildSpec("agent-b", "x", {"BEHAVE": "engine"}, tier=3))
    engines = [int(Path(f"{rec}.agent-{n}.engine").read_text()) for n in "ab"]
    assert all(not gone(p) for p in engines)
    # Each child and engine is in its own process group, not ours: a terminal's Ctrl-C reaches `up` alone.
    assert all(os.getpgid(c.pid) == c.pid != os.getpgid(0) for c in sup.children)

    sup.stop_all()
    order = rec.read_text().split()
    assert sorted(order[:2]) == ["agent-a", "agent-b"]
    assert order[2:] == ["router", "cp"]
    assert all(not c.alive() for c in sup.children)
    # The agents left their engines (as a crashed agent would): the sweep finds them.
    killed = {int(k.split()[0]) for k in sup.sweep()}
    assert set(engines) <= killed
    eventually_sync(lambda: all(gone(p) for p in engines), what="the swept engines to be gone")
    assert run_processes(sup.run_token, sup.layout.data_dir) == []


def test_a_process_that_is_no_descendant_is_found_by_the_run_marker(sup: Supervisor, rec: Path) -> None:
    start_ready(sup, rec, ChildSpec("agent", "x", {"BEHAVE": "detached"}, tier=3))
    engine = int(Path(f"{rec}.agent.engine").read_text())
    assert engine not in {p.pid for p in psutil.Process(sup.children[0].pid).children(recursive=True)}
    assert psutil.Process(engine).environ()[RUN_MARKER] == sup.run_token
    assert engine in run_processes(sup.run_token)
    sup.stop_all()
    assert engine in {int(k.split()[0]) for k in sup.sweep()}
    eventually_sync(lambda: gone(engine), what="the swept engine to be gone")


@pytest.mark.slow
def test_a_child_that_ignores_sigterm_is_killed_after_its_grace(sup: Supervisor, rec: Path) -> None:
    start_ready(sup, rec, ChildSpec("stubborn", "x", {"BEHAVE": "stubborn"}, tier=0, grace_s=0.5))
    t0 = time.monotonic()
    sup.stop_all()
    took = time.monotonic() - t0
    assert rec.read_text().split() == ["stubborn"]  # it did get the SIGTERM first
    assert not sup.children[0].alive()
    assert sup.children[0].proc.returncode == -signal.SIGKILL
    assert 0.5 <= took < 5


def test_hurry_cuts_the_grace_short(sup: Supervisor, rec: Path) -> None:
    """A second Ctrl-C: SIGKILL now rather than after the grace."""
    start_ready(sup, rec, ChildSpec("stubborn", "x", {"BEHAVE": "stubborn"}, tier=0, grace_s=60))
    again = threading.Event()
    threading.Timer(0.3, again.set).start()
    t0 = time.monotonic()
    sup.stop_all(hurry=again.is_set)
    assert time.monotonic() - t0 < 10
    assert rec.read_text().split() == ["stubborn"]
    assert sup.children[0].proc.returncode == -signal.SIGKILL


def test_a_child_dying_during_start_is_named_with_its_log(
    sup: Supervisor, rec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start_ready(sup, rec, ChildSpec("cp", "x", {}, tier=0))
    crash = sup.start(ChildSpec("router", "x", {"BEHAVE": "crash"}, tier=1))
    crash.proc.wait(10)
    stop = StopFlag(threading.Event())
    code = wait_ready_then_serve(stop, time.monotonic(), sup, None, sup.layout, Catalog(), "k", {}, 30.0)
    assert code == 1
    errout = capsys.readouterr().err
    assert f"error: router exited with code 3 during start; last lines of {crash.log_path}:" in errout
    assert "  | boom: cannot bind" in errout
    assert "cp exited" not in errout


@pytest.mark.slow
def test_no_first_completion_in_time_says_what_the_router_answered(
    sup: Supervisor, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmgw_common.catalog import parse_catalog

    cat = parse_catalog("models: [{name: m1, engine: sim}]")
    stop = StopFlag(threading.Event())
    code = wait_ready_then_serve(stop, time.monotonic(), sup, None, sup.layout, cat, "k", {}, 0.3)
    assert code == 1
    errout = capsys.readouterr().err
    assert "error: no chat completion succeeded within 0 s; last answers:" in errout
    assert "  m1: router not answering (ConnectError)" in errout


@pytest.mark.slow
def test_children_die_with_a_killed_up(tmp_path: Path, rec: Path) -> None:
    """SIGKILL of `llmgw up` itself still stops its children (PR_SET_PDEATHSIG)."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from llmgw_cli.devcluster import Supervisor
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from tests.cli.test_up_supervisor import make_layout, STANDIN, ChildSpec
        sup = Supervisor(make_layout(Path({str(tmp_path)!r})), "tok",
                         argv_for=lambda s, l: [sys.executable, "-c", STANDIN, s.name, {str(rec)!r}])
        c = sup.start(ChildSpec("agent", "x", {{}}, tier=3))
        print(c.pid, flush=True)
        time.sleep(600)
        """
    )
    up = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        child = int(up.stdout.readline())
        eventually_sync(lambda: Path(f"{rec}.agent.ready").exists(), what="the agent to say it is ready")
        up.kill()
        up.wait(5)
        eventually_sync(lambda: gone(child), what="the killed up's child to be gone")
        assert rec.read_text().split() == ["agent"]  # it was told with SIGTERM, not killed
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if up.stdout is not None:
            up.stdout.close()


def test_child_env_drops_foreign_settings_and_marks_the_run(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    spec = ChildSpec("router", "router", {"LLMGW_PORT": "9"}, tier=1)
    base = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LLMGW_CONFIG": "/etc/other.yaml",
        "LLMGW_PORT": "1",
        "LLMGW_NATS_URLS": "nats://elsewhere:4222",
        "LLMGW_NATS_TOKEN": "s3cret",
    }
    env = child_env(spec, layout, "tok", base)
    assert "LLMGW_CONFIG" not in env and "LLMGW_NATS_URLS" not in env
    assert env["LLMGW_PORT"] == "9"
    assert env["LLMGW_NATS_TOKEN"] == "s3cret"
    assert env["LLMGW_PREFIX"] == "t"
    assert env[RUN_MARKER] == "tok"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_plan_starts_services_then_agents_each_with_own_state(tmp_path: Path) -> None:
    fleet = parse_fleet("nodes: [{name: gpu-a1, gpus: 8xH100-80GB}, {name: gpu-b1, gpus: 4xA100-80GB}]")
    specs = plan_children(make_layout(tmp_path), fleet)
    assert [s.name for s in specs] == [
        "controlplane",
        "router",
        "notifier",
        "agent-local",
        "agent-gpu-a1",
        "agent-gpu-b1",
    ]
    assert [s.tier for s in specs] == sorted(s.tier for s in specs)
    agents = specs[3:]
    assert len({s.env["LLMGW_STATE_DIR"] for s in agents}) == 3
    local = agents[0].env
    assert local["LLMGW_NODE"] == "local"
    assert "LLMGW_SIM_GPUS" not in local and "LLMGW_SIMULATE_ENGINES" not in local
    assert agents[1].env["LLMGW_SIM_GPUS"] == "8xH100-80GB"
    assert specs[2].env["LLMGW_PROBE_KEY"] == "k"
    no_local = plan_children(dataclasses.replace(make_layout(tmp_path), local_agent=False), fleet)
    assert "agent-local" not in [s.name for s in no_local]


def test_sweep_spares_other_processes_naming_the_data_dir(sup: Supervisor, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "router.log"
    # A user's `tail -f` of a log, and a stand-in for a nats-server left by a crashed run.
    tail = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(log)])
    script = 'exec -a nats-server "$0" -c "import time; time.sleep(600)" -sd "$1"'
    fake_nats = subprocess.Popen(["bash", "-c", script, sys.executable, str(tmp_path / "nats" / "jetstream")])
    try:
        eventually_sync(
            lambda: "nats-server" in " ".join(psutil.Process(fake_nats.pid).cmdline()),
            what="the stand-in to be named nats-server",
        )
        found = run_processes("no-such-token", tmp_path)
        assert fake_nats.pid in found
        assert tail.pid not in found
        assert os.getpid() not in found
    finally:
        for p in (tail, fake_nats):
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    ("argv", "ours"),
    [
        (["/x/.venv/bin/nats-server", "-js", "-sd", "/d/nats/jetstream"], True),
        (["/x/llmgw/.venv/bin/python3", "-m", "llmgw_cli", "agent"], True),
        (["/x/.venv/bin/python", "/x/.venv/bin/llmgw", "sim-engine"], True),
        (["llmgw", "up"], True),
        (["/x/llmgw/.venv/bin/python", "script.py", "/d/logs/router.log"], False),
        (["/x/llmgw/.venv/bin/python", "-m", "llmgw_tools", "/d"], False),
        (["/home/llmgw/bin/tail", "-f", "/d/logs/router.log"], False),
        (["/x/.venv/bin/python", "/x/llmgw/notes.py", "/d"], False),
        ([], False),
    ],
)
def test_a_run_entry_point_is_judged_by_its_shape(argv: list[str], ours: bool) -> None:
    assert is_run_entry_point(argv) is ours


def test_sweep_spares_a_python_of_a_clone_named_llmgw(tmp_path: Path) -> None:
    """`git clone` of llmgw makes a folder named llmgw, so its venv's python is …/llmgw/.venv/bin/python:
    a user's script run by it that names the data dir is the user's, whatever folder the suite runs in.
    An llmgw entry point naming the data dir (a console script, as pip writes one) is still the run's."""
    bindir = tmp_path / "src" / "llmgw" / ".venv" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python"
    python.symlink_to(sys.executable)
    data = tmp_path / "data"
    script = bindir / "llmgw"
    script.write_text(f"#!{python}\nimport time\ntime.sleep(600)\n")
    script.chmod(0o755)
    users = [
        subprocess.Popen(
            [str(python), "-c", "import time; time.sleep(600)", str(data / "logs" / "router.log")]
        ),
        # A command word that merely contains "llmgw" is no llmgw entry point either.
        subprocess.Popen([str(python), "-c", "import time; time.sleep(600)", "llmgw", str(data)]),
    ]
    ours = subprocess.Popen([str(script), "sim-engine", "--kv-events-endpoint", f"ipc://{data}/agents/a/kv"])
    try:
        eventually_sync(
            lambda: all(len(psutil.Process(p.pid).cmdline()) > 2 for p in (*users, ours)),
            what="the processes to be started",
        )
        found = run_processes("no-such-token", data)
        assert [p.pid for p in users if p.pid in found] == []
        assert ours.pid in found
    finally:
        for p in (*users, ours):
            p.kill()
            p.wait()


@pytest.mark.slow
def test_dead_children_and_nats_are_restarted_with_backoff_and_announced(
    sup: Supervisor, rec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start_ready(sup, rec, ChildSpec("cp", "x", {}, tier=0))
    sup.start(ChildSpec("router", "x", {"BEHAVE": "crash"}, tier=1))  # exits 3 at every start
    nats = NatsServer(tmp_path / "nats").start()
    port = nats.port
    restarts = Restarts(base_s=0.1, max_s=0.4)
    stop = StopFlag(threading.Event())
    state: dict[str, object] = {}
    codes: list[int] = []
    t = threading.Thread(
        target=lambda: codes.append(supervise(stop, sup, nats, state, restarts, every_s=0.02))
    )
    t.start()
    try:
        eventually_sync(
            lambda: restarts.count.get("router", 0) >= 4,
            timeout=20,
            what="the router to be restarted four times",
        )
        cp = sup.children[0]
        os.remove(f"{rec}.cp.ready")
        cp.proc.kill()
        old_nats = nats.pid
        assert old_nats is not None
        os.kill(old_nats, signal.SIGKILL)
        eventually_sync(
            lambda: Path(f"{rec}.cp.ready").exists(), timeout=20, what="the control plane to say it is ready"
        )
        eventually_sync(
            lambda: nats.pid not in (None, old_nats) and nats._healthy(),
            timeout=20,
            what="a new, healthy nats-server in place of the killed one",
        )
        assert nats.port == port  # clients reconnect to the same URL
        assert sup.children[0].pid != cp.pid and sup.children[0].alive()
        assert [c.spec.name for c in sup.children] == ["cp", "router"]  # stop order kept
    finally:
        stop.event.set()
        t.join(10)
        nats.stop()
    assert codes == [0]
    err = capsys.readouterr().err
    log = sup.children[1].log_path
    # One line per death: the child, its exit code, how long it lived (a crash at start: 0 s, or 1 s
    # on a loaded box, where the Python child takes that long to start), the delay (doubling, capped)
    # and the restart count.
    for n, delay in ((1, "0.1"), (2, "0.2"), (3, "0.4"), (4, "0.4")):
        line = (
            r"llmgw up: router exited with code 3 after [01]s; "
            rf"restarting it in {delay}s \(restart {n}\); see {re.escape(str(log))}"
        )
        assert re.search(line, err), (line, err)
    assert "llmgw up: cp exited with code -9 (SIGKILL) after " in err
    assert "llmgw up: nats-server exited with code -9 (SIGKILL) after " in err
    assert f"llmgw up: cp restarted (pid {sup.children[0].pid})" in err
    assert "llmgw up: nats-server restarted (pid " in err
    # The state file (up.json) tells the pids and restart counts.
    listed = state["children"]
    assert isinstance(listed, list)
    children = {c["name"]: c for c in listed}
    assert children["cp"]["restarts"] == 1 and children["cp"]["pid"] == sup.children[0].pid
    assert children["router"]["restarts"] >= 4
    assert state["nats_restarts"] == 1
    # Stopping still leaves nothing behind.
    sup.stop_all()
    sup.sweep()
    eventually_sync(
        lambda: run_processes(sup.run_token, sup.layout.data_dir) == [],
        what="no process of the run to be left",
    )
