"""Fixtures of the agent tests (helpers live in agent_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from llmgw_agent.supervisor import Supervisor
from tests.agent.agent_helpers import ENGINE_SCRIPT, Recorder, kill_group


@pytest.fixture
def engine_script(tmp_path: Path) -> Path:
    p = tmp_path / "engine.py"
    p.write_text(ENGINE_SCRIPT)
    return p


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, Recorder]]:
    rec = Recorder()
    s = Supervisor(tmp_path / "state", rec, stop_grace_s=0.5, health_interval_s=0.2, health_failures=3)
    yield s, rec
    await s.stop_all()
    await s.aclose()


@pytest.fixture
def reap_groups() -> Iterator[list[int]]:
    """Process groups a test leaves behind on failure are killed at teardown."""
    groups: list[int] = []
    yield groups
    for g in groups:
        kill_group(g)
