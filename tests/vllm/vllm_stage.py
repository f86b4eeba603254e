"""The vLLM tests' one cluster, kept across tests and modules and brought to each test's catalog.

A vLLM start costs 30-100 s of both cores, and a new cluster costs three of them; a catalog apply
costs only the starts of what is new. So a test names the catalog it needs (the ``vllm_catalog``
marker, else its module's ``CATALOG``, else the default) and the stage applies it when the cluster
serves another, then waits until the routing table lists every model in it with its replicas and
every model it dropped with none. A test that ends in another catalog (one that stopped a model)
leaves it: the next test asks for its own.

A test that needs only some models serving names them (``vllm_waits_for``): a replica still starting
for another (the replacement of one a test killed) starts meanwhile and is waited for by the next
test that needs it. A test that fails leaves the cluster in a state nobody knows; the next test gets
a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from pathlib import Path

import yaml

from tests.chaos.chaos_waits import mint_key
from tests.kit.ports import free_port
from tests.vllm.vllm_cluster import SETTINGS, VllmCluster, endpoints
from tests.vllm.vllm_kit import VllmInstall, describe


def replica_counts(catalog: str) -> dict[str, int]:
    """Each model of a catalog and the replicas it asks for."""
    return {str(m["name"]): int(str(m.get("replicas", 1))) for m in yaml.safe_load(catalog)["models"]}


class ClusterStage:
    def __init__(self, install: VllmInstall, new_root: Callable[[], Path]) -> None:
        self.install, self.new_root = install, new_root
        self.cluster: VllmCluster | None = None
        self.key = ""
        self.boots = 0
        self.spoiled = False

    def serve(self, catalog: str, wait_for: Collection[str] | None = None) -> tuple[VllmCluster, str]:
        """The cluster serving ``catalog``: every replica of the models in ``wait_for`` (default: all of
        them) ready."""
        if self.cluster is not None and self.spoiled:
            self.close()
        counts = replica_counts(catalog)
        wanted = counts if wait_for is None else {m: counts[m] for m in wait_for}
        if self.cluster is None:
            self._boot(catalog, wanted)
        elif self.cluster.applied != catalog:
            t0 = time.monotonic()
            asyncio.run(self._bring(catalog, wanted))
            print(f"vllm stage: brought to {counts} in {time.monotonic() - t0:.1f} s")
        else:
            # The same catalog: the routing table lists the wanted replicas again (a killed one is
            # replaced; the test after it that needs its model waits here).
            asyncio.run(self._wait(wanted))
        assert self.cluster is not None
        return self.cluster, self.key

    def _boot(self, catalog: str, wanted: dict[str, int]) -> None:
        c = VllmCluster(
            self.new_root(), prefix="vllm", settings=dict(SETTINGS), catalog=catalog, install=self.install
        )
        self.cluster, self.spoiled = c, False
        t0 = time.monotonic()
        try:
            c.start_nats()
            c.start_controlplane()
            # Its /metrics where a test can read it (routing by cached prefix: tokenizers, predictions).
            c.start_router(admin_port=free_port())
            c.start_real_agent("node-a", "0")
            c.start_real_agent("node-b", "1")
            self.key = mint_key(c)
            c.wait_router()
            asyncio.run(self._wait(wanted))
        except BaseException:
            self.close()
            raise
        self.boots += 1
        print(
            f"vllm stage: cluster {self.boots} serving {wanted} of {replica_counts(catalog)} {time.monotonic() - t0:.1f} s after start"
        )

    def engine_url(self, model: str) -> str:
        """One serving engine of ``model``, asked directly (not through the router)."""
        assert self.cluster is not None
        table = asyncio.run(endpoints(self.cluster, model, replica_counts(self.cluster.applied)[model]))
        return min(e.url for e in table.endpoints[model])

    async def _bring(self, catalog: str, wanted: dict[str, int]) -> None:
        assert self.cluster is not None
        before = replica_counts(self.cluster.applied)
        await self.cluster.apply(catalog)
        # A model the catalog drops is waited out of the routing table too (its engines stop within the
        # cluster's stop grace, 10 s): its memory is free for what comes.
        dropped = {m: 0 for m in before if m not in replica_counts(catalog)}
        await self._wait({**dropped, **wanted})

    async def _wait(self, counts: dict[str, int]) -> None:
        assert self.cluster is not None
        for model, n in counts.items():
            await endpoints(self.cluster, model, n)

    def close(self) -> None:
        """Stop the cluster; no vLLM process of it may be left."""
        c, self.cluster = self.cluster, None
        if c is None:
            return
        c.close()
        left = c.vllm_pids()
        assert not left, f"vLLM processes outlived the cluster: {describe(sorted(left))}"
