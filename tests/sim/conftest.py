"""Fixtures of the simulated-engine tests: in-process engines, and engines as real processes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw_sim.options import SimOptions
from llmgw_sim.serving import Listening, start
from tests.sim.sim_testkit import EngineProcess

LISTEN_RE = re.compile(rb"sim-engine listening on (http://\S+)")


@pytest.fixture
async def engine() -> AsyncIterator[Callable[..., Awaitable[Listening]]]:
    """Factory: an in-process engine on a free port, with the given SimOptions fields."""
    started: list[Listening] = []

    async def make(**kw: Any) -> Listening:
        kw.setdefault("port", 0)
        srv = await start(SimOptions(**kw))
        started.append(srv)
        return srv

    yield make
    for srv in started:
        await srv.runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        yield s


@pytest.fixture
async def engine_process(tmp_path: Path) -> AsyncIterator[Callable[[SimOptions], Awaitable[EngineProcess]]]:
    """Factory: ``llmgw sim-engine`` as a real child process, in its own session, as the agent runs it."""
    procs: list[EngineProcess] = []

    async def spawn(opts: SimOptions) -> EngineProcess:
        log = tmp_path / f"engine-{len(procs)}.log"
        with log.open("wb") as errf:
            proc = await asyncio.create_subprocess_exec(
                *opts.command(),
                stdout=asyncio.subprocess.PIPE,
                stderr=errf,
                start_new_session=True,
            )
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"engine did not print its address; log: {log.read_text()}") from None
        m = LISTEN_RE.search(line)
        if m is None:
            await proc.wait()
            raise AssertionError(f"engine exited ({proc.returncode}) without listening: {log.read_text()}")
        ep = EngineProcess(proc, m.group(1).decode(), log)
        procs.append(ep)
        return ep

    yield spawn
    for ep in procs:
        await ep.stop()
