"""The vLLM tests' inputs: the ``make vllm`` install (skipped, saying what is missing, without it), the
session's one llmgw cluster around real vLLM (vllm_stage.py: nats-server, a control plane, a router and
two agents, nodes ``node-a`` and ``node-b``, a core each), brought to each test's catalog (the
``vllm_catalog`` marker, else the module's ``CATALOG``; default: gemma on two replicas and minilm on
one), and one gemma server shared by the modules that ask vLLM directly.

The modules run on one worker (the ``vllm`` xdist group), in name order: argv, cluster,
cluster_lifecycle (both on the stage), fidelity, fidelity_sdks (both on the shared gemma). The stage
and the shared gemma never run at once: each gemma takes 5.3 GB and a cluster runs up to three.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import openai
import pytest

from tests.vllm.vllm_cluster import CATALOG, VllmCluster
from tests.vllm.vllm_kit import SharedGemma, VllmInstall, require_vllm
from tests.vllm.vllm_stage import ClusterStage


@pytest.fixture(scope="session")
def vllm_install() -> VllmInstall:
    return require_vllm()


@pytest.fixture(scope="session")
def vllm_slots(
    vllm_install: VllmInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ClusterStage, SharedGemma]]:
    """The stage and the shared gemma, each stopping the other before it starts."""
    gemma: SharedGemma | None = None

    def stop_gemma() -> None:
        if gemma is not None:
            gemma.close()

    stage = ClusterStage(vllm_install, lambda: Path(tmp_path_factory.mktemp("vllm-cluster")), stop_gemma)
    gemma = SharedGemma(
        vllm_install, Path(tmp_path_factory.mktemp("vllm-shared-gemma")), make_room=stage.close
    )
    try:
        yield stage, gemma
    finally:
        gemma.close()
        stage.close()


@pytest.fixture(scope="session")
def shared_gemma(vllm_slots: tuple[ClusterStage, SharedGemma]) -> SharedGemma:
    return vllm_slots[1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    slots = getattr(item, "funcargs", {}).get("vllm_slots")
    if report.failed and slots is not None:
        # What a failed test left on the cluster is unknown: the next test gets a new one.
        slots[0].spoiled = True
    return report


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, vllm_slots: tuple[ClusterStage, SharedGemma]
) -> tuple[VllmCluster, str]:
    """The stage serving this test's catalog."""
    marker = request.node.get_closest_marker("vllm_catalog")
    catalog = str(marker.args[0]) if marker is not None else getattr(request.module, "CATALOG", CATALOG)
    return vllm_slots[0].serve(catalog)


@pytest.fixture
async def client(cluster: tuple[VllmCluster, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    c, key = cluster
    oc = openai.AsyncOpenAI(base_url=f"{c.router_url()}/v1", api_key=key, max_retries=0, timeout=180)
    yield oc
    await oc.close()
