from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw_router.service import Router
from llmgw_router.settings import RouterSettings
from llmgw_sim import serving as sim_engine
from llmgw_sim.options import SimOptions
from tests.kit.ports import free_port
from tests.router.router_helpers import EngineFactory, PortFactory, RouterFactory, StaticFile


@pytest.fixture
async def engines() -> AsyncIterator[EngineFactory]:
    """Start in-process simulated engines (zero delay unless timing is given)."""
    started: list[sim_engine.Listening] = []

    async def make(model: str = "m1", **kw: Any) -> sim_engine.Listening:
        if "ttft_ms" not in kw and "tokens_per_s" not in kw:
            kw.setdefault("zero", True)
        srv = await sim_engine.start(SimOptions(port=0, model=model, **kw))
        started.append(srv)
        return srv

    yield make
    for s in started:
        with contextlib.suppress(RuntimeError):
            await s.runner.cleanup()


@pytest.fixture
async def routers(tmp_path: Path) -> AsyncIterator[RouterFactory]:
    """Start in-process routers on free ports: ``static`` (a dict written as the static file) or bus."""
    started: list[Router] = []

    async def make(static: dict[str, Any] | None = None, follow_bus: bool | None = None, **kw: Any) -> Router:
        if static is not None:
            path = tmp_path / f"static-{len(started)}.yaml"
            path.write_text(yaml.safe_dump(static))
            kw["static_file"] = str(path)
        kw.setdefault("router_id", f"rt{len(started)}")
        settings = RouterSettings(port=0, **kw)
        r = Router(settings, follow_bus=follow_bus)
        await r.start()
        started.append(r)
        return r

    yield make
    for r in started:
        await r.stop()


def _static_file(models: dict[str, list[str]], **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"models": [{"name": m, "endpoints": urls} for m, urls in models.items()]}
    out.update(extra)
    return out


@pytest.fixture
def static_file() -> StaticFile:
    """Build a static-mode file: ``static_file({"m": [url, ...]}, keys=[...], auth=False)``."""
    return _static_file


@pytest.fixture
def port() -> PortFactory:
    return free_port
