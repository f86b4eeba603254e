"""A replica whose engine cannot start stays explained (issue 12 item 15), with every part a real process.

The engine is the real simulator started with an argument it refuses, so it exits at once and the agent
reports the shard failed with its log tail. The control plane stops the replica on its next pass; many
passes later `llmgw ctl replicas -o json`, `ctl replicas --failed` and `ctl models` must still show the
error and the engine's last lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.chaos_bus import BUS_ERRORS, BusView
from tests.chaos.chaos_harness import AGGRESSIVE, ChaosCluster
from tests.kit.poll import eventually
from tests.operator.test_operator_drain import _ctl

pytestmark = [pytest.mark.xdist_group("operator"), pytest.mark.e2e, pytest.mark.slow]

CATALOG = """\
models:
  - name: broken
    engine: sim
    replicas: 1
    startup_timeout_s: 30
    args: ["--no-such-flag"]
"""
BAD = "no-such-flag"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosCluster]:
    c = ChaosCluster(Path(tmp_path_factory.mktemp("operator-failures")), prefix="fails", catalog=CATALOG)
    c.settings = dict(AGGRESSIVE)
    try:
        c.start_nats()
        c.start_controlplane()
        c.start_agent("n1")
        yield c
    finally:
        c.close()


def _explained(info: dict[str, Any]) -> bool:
    """A replica whose failed shard carries the engine's error and a log tail that names the bad flag."""
    return any(
        s.get("error") and any(BAD in line for line in s.get("log_tail", ())) for s in info.get("shards", ())
    )


async def test_a_failed_engine_stays_explained_many_passes_later(cluster: ChaosCluster) -> None:
    c = cluster
    view = await BusView.connect(c.nats_url, c.prefix)
    try:
        await eventually(
            view.stats, timeout=30, every=0.2, what="a control plane to answer", tolerate=BUS_ERRORS
        )

        async def a_failure() -> str | None:
            reply = json.loads(await _ctl(c, "replicas", "-o", "json"))
            seen = [*reply["replicas"], *reply.get("failed", [])]
            return next((r["id"] for r in seen if _explained(r)), None)

        rid = await eventually(
            a_failure,
            timeout=60,
            every=0.2,
            what="a replica failed with the engine's log tail",
            tolerate=BUS_ERRORS,
        )
        assert rid is not None
        stats = await view.stats()
        assert stats is not None
        start = stats.passes

        async def passes_later() -> bool:
            s = await view.stats()
            return s is not None and s.passes >= start + 12

        await eventually(
            passes_later, timeout=30, every=0.2, what="a dozen more reconcile passes", tolerate=BUS_ERRORS
        )

        replicas = json.loads(await _ctl(c, "replicas", "-o", "json"))
        assert rid not in {r["id"] for r in replicas["replicas"]}  # it was stopped...
        kept = {r["id"]: r for r in replicas.get("failed", [])}
        assert rid in kept, replicas  # ...and is still explained
        f = kept[rid]
        assert f["state"] == "failed" and f["failed_at"] > 0 and f["model"] == "broken"
        assert f["error"] and "shard 0 on n1" in f["error"], f
        assert _explained(f), f

        models = {m["name"]: m for m in json.loads(await _ctl(c, "models", "-o", "json"))["models"]}
        last = models["broken"]["last_failure"]
        assert last is not None and _explained(last), models

        table = await _ctl(c, "models")
        assert "last failures" in table and "broken: broken-" in table, table
        shown = await _ctl(c, "replicas", "--failed")
        assert rid in shown and "shard 0 on n1" in shown and BAD in shown, shown
        assert "--failed" in await _ctl(c, "replicas")  # the plain table points at the failures
    finally:
        await view.close()
