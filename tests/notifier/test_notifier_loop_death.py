"""A delivery worker or probe loop that dies ends the notifier (TaskDied: exit 70, so that its supervisor
restarts it), as a dead loop does in every service; it is no longer revived in place every 5 s."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmgw_common.catalog import WatchSpec
from llmgw_common.messages import Webhook
from llmgw_notifier import service
from llmgw_notifier.delivery import TargetWorker
from llmgw_notifier.probes import Prober
from llmgw_notifier.stats import NotifierStats
from llmgw_runtime.natsserver import NatsServer
from llmgw_runtime.runtime import TaskDied
from tests.notifier.notifier_helpers import Bus, fast_settings


async def _serve_until_it_ends(nats_server: NatsServer, prefix: str) -> asyncio.Task[None]:
    """The notifier's task once it ended on its own within 20 s; stopped and failed otherwise."""
    stop = asyncio.Event()
    task = asyncio.create_task(service.serve(fast_settings(nats_server, prefix), stop, NotifierStats()))
    await asyncio.wait({task}, timeout=20)
    if not task.done():
        stop.set()
        await asyncio.wait_for(task, 15)
        pytest.fail("the notifier went on with a dead loop")
    return task


async def test_a_delivery_worker_that_dies_ends_the_notifier(
    nats_server: NatsServer, prefix: str, bus: Bus, receivers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "HOUSEKEEPING_S", 0.1)
    starts = [0]

    async def dies(self: TargetWorker) -> None:
        starts[0] += 1
        raise KeyError("a bug in the worker")

    monkeypatch.setattr(TargetWorker, "run", dies)
    a = await receivers()
    await bus.set_webhooks(Webhook(url=a.url))
    task = await _serve_until_it_ends(nats_server, prefix)
    with pytest.raises(TaskDied, match=r"task notifier-target-\S+ raised KeyError"):
        task.result()
    assert starts[0] == 1  # not revived before the end


@pytest.mark.slow
async def test_a_probe_loop_that_dies_ends_the_notifier(
    nats_server: NatsServer, prefix: str, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "HOUSEKEEPING_S", 0.1)
    starts = [0]

    async def dies(self: Prober, model: str, spec: WatchSpec) -> None:
        starts[0] += 1
        raise ValueError(f"a bug in the probe of {model}")

    monkeypatch.setattr(Prober, "_loop", dies)
    await bus.set_watched({"judge": WatchSpec(probe_every=0.2, budget=0.2, failures=2)})
    task = await _serve_until_it_ends(nats_server, prefix)
    with pytest.raises(TaskDied, match="task probe-judge raised ValueError: a bug in the probe of judge"):
        task.result()
    assert starts[0] == 1
