from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from llmgw_runtime.natsserver import NatsServer, ensure_on_path
from tests.loopguard import BlockedLoopGuard

ensure_on_path()

# Nothing runs in asyncio's debug mode, which `PYTHONASYNCIODEBUG` would pass down to every process the
# suite starts: the services run as in production. In debug mode each task and handle records the stack
# it was made at: an operator and chaos subset took 28 % more CPU with it (152 s against 110 s), on a
# 2-core box whose full run is CPU-bound. The suite's own loops are checked by the loop guard instead.
os.environ.pop("PYTHONASYNCIODEBUG", None)


# A test that runs real processes (e2e) or long real-time work (slow) is run once more when it fails:
# on the 2-core CI machines, where a vLLM start and a compile share the cores with the other worker,
# each full run of the ~1,900 tests failed one different such test on a timing (three runs, three
# tests, each passing alone). A behaviour that is broken fails both runs and the suite; a rerun is
# listed in the summary (`R`) so a test that needs one is seen. LLMGW_TEST_RERUNS=0 turns it off.
RERUNS = int(os.environ.get("LLMGW_TEST_RERUNS", "1"))


def rerun_marker(item: pytest.Item, reruns: int = RERUNS) -> pytest.MarkDecorator | None:
    """The rerun a test gets: one for e2e and slow tests, none for the fast tier (whose failures are
    never a loaded machine's timing) or where the test says otherwise with its own ``flaky`` mark."""
    if reruns <= 0 or item.get_closest_marker("flaky") is not None:
        return None
    if item.get_closest_marker("e2e") is None and item.get_closest_marker("slow") is None:
        return None
    return pytest.mark.flaky(reruns=reruns, reruns_delay=1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark = rerun_marker(item)
        if mark is not None:
            item.add_marker(mark)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Why each rerun test failed its first run: the rerun summary names it only, and a CI log is often
    all there is to find a load-dependent failure's cause from."""
    reruns = terminalreporter.stats.get("rerun", [])
    if not reruns:
        return
    terminalreporter.section("why each rerun test failed its first run")
    for rep in reruns:
        text = getattr(rep, "longreprtext", "") or "(no failure text)"
        lines = text.splitlines()
        terminalreporter.write_line(f"{rep.nodeid} ({rep.when}):")
        for line in lines[-40:]:
            terminalreporter.write_line(f"    {line}")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One real nats-server with JetStream for the session (per xdist worker)."""
    srv = NatsServer(tmp_path_factory.mktemp("nats"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A subject prefix unique to the test, so tests can share one server without crosstalk."""
    import re

    # The test's name for reading logs, and a hash of its whole id: tests of the same name in two files
    # (three are called test_stop_ends_a_loop_that_swallowed_a_cancel) would otherwise share buckets
    # and a leader lease when one worker runs both.
    name = re.sub(r"[^A-Za-z0-9]", "", request.node.name)[-20:]
    tag = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    # A rerun (rerun_marker) gets a prefix of its own: with the first run's, it read that run's
    # assignment and heard its agent's last status messages (an agent test failed its rerun so).
    run = getattr(request.node, "execution_count", 1)
    again = f"r{run}" if run > 1 else ""
    return f"t{os.getpid()}{name}{tag}{again}".lower()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
def artifacts_dir() -> Path:
    d = Path(__file__).resolve().parent.parent / "test-artifacts"
    d.mkdir(exist_ok=True)
    return d


# Over this, one step of a test's event loop fails the test (tests/loopguard.py); 0 turns it off. The
# worst blocking steps it was made for held the loop 6-20 s; a real llama.cpp test's last step took 2.1 s on a
# loaded CI box, so 5 s.
LOOP_BLOCKED_LIMIT_S = float(os.environ.get("LLMGW_TEST_LOOP_BLOCKED_S", "5.0"))


@pytest.fixture(autouse=True)
def _loop_not_blocked() -> Iterator[None]:
    """Autouse, so set up before the test's event loop and torn down after it closed: it sees every
    step of that loop, its teardown included."""
    if LOOP_BLOCKED_LIMIT_S <= 0:
        yield
        return
    with BlockedLoopGuard(LOOP_BLOCKED_LIMIT_S).watching() as guard:
        yield
    if guard.steps:
        pytest.fail(guard.report(), pytrace=False)
