"""The vLLM tests' one cluster, kept across tests and modules and brought to each test's catalog.

A vLLM start costs 30-100 s of both cores, and a new cluster costs three of them; a catalog apply
costs only the starts of what is new. So a test names the catalog it needs (the ``vllm_catalog``
marker, else its module's ``CATALOG``, else the default) and the stage applies it when the cluster
serves another, then waits until the routing table lists every model in it with its replicas and
every model it dropped with none. A test that ends in another catalog (one that stopped a model)
leaves it: the next test asks for its own.

The stage never runs beside the shared gemma (each gemma takes 5.3 GB): starting either stops the
other. A test that fails leaves the cluster in a state nobody knows; the next test gets a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.chaos.chaos_harness import mint_key
from tests.vllm.vllm_cluster import SETTINGS, VllmCluster, endpoints
from tests.vllm.vllm_kit import VllmInstall, describe


def replica_counts(catalog: str) -> dict[str, int]:
    """Each model of a catalog and the replicas it asks for."""
    return {str(m["name"]): int(str(m.get("replicas", 1))) for m in yaml.safe_load(catalog)["models"]}


class ClusterStage:
    def __init__(
        self, install: VllmInstall, new_root: Callable[[], Path], make_room: Callable[[], None]
    ) -> None:
        self.install, self.new_root, self.make_room = install, new_root, make_room
        self.cluster: VllmCluster | None = None
        self.key = ""
        self.boots = 0
        self.spoiled = False

    def serve(self, catalog: str) -> tuple[VllmCluster, str]:
        """The cluster serving exactly ``catalog``, every replica ready."""
        if self.cluster is not None and self.spoiled:
            self.close()
        if self.cluster is None:
            self.make_room()
            self._boot(catalog)
        elif self.cluster.applied != catalog:
            t0 = time.monotonic()
            asyncio.run(self._bring(catalog))
            print(f"vllm stage: brought to {replica_counts(catalog)} in {time.monotonic() - t0:.1f} s")
        else:
            # The same catalog: the routing table lists every replica again (a test that killed one
            # waits for its replacement itself: the killed one may still be listed for a moment).
            asyncio.run(self._wait(replica_counts(catalog)))
        assert self.cluster is not None
        return self.cluster, self.key

    def _boot(self, catalog: str) -> None:
        c = VllmCluster(
            self.new_root(), prefix="vllm", settings=dict(SETTINGS), catalog=catalog, install=self.install
        )
        self.cluster, self.spoiled = c, False
        t0 = time.monotonic()
        try:
            c.start_nats()
            c.start_controlplane()
            c.start_router()
            c.start_real_agent("node-a", "0")
            c.start_real_agent("node-b", "1")
            self.key = mint_key(c)
            c.wait_router()
            asyncio.run(self._wait(replica_counts(catalog)))
        except BaseException:
            self.close()
            raise
        self.boots += 1
        print(
            f"vllm stage: cluster {self.boots} serving {replica_counts(catalog)} {time.monotonic() - t0:.1f} s after start"
        )

    async def _bring(self, catalog: str) -> None:
        assert self.cluster is not None
        before = replica_counts(self.cluster.applied)
        await self.cluster.apply(catalog)
        counts = replica_counts(catalog)
        # A model the catalog drops is waited out of the routing table too (its engines stop within the
        # cluster's stop grace, 10 s).
        await self._wait({**dict.fromkeys(before, 0), **counts})

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
