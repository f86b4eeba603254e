"""The vLLM tests' inputs: the ``make vllm`` install (skipped, saying what is missing, without it), an
llmgw cluster around real vLLM for each module that asks for one (nats-server, a control plane, a
router and two agents, nodes ``node-a`` and ``node-b``, a core each, serving the module's ``CATALOG``;
default: gemma on two replicas and minilm on one), and one gemma server shared by the modules that ask
vLLM directly.

The modules run on one worker (the ``vllm`` xdist group), in name order: argv, cluster, fidelity,
fidelity_sdks, lifecycle. The shared gemma is started by fidelity, used again by fidelity_sdks (a vLLM
start costs 30-100 s of both cores on the suite's longest chain), and stopped before a cluster boots:
each gemma takes 5.3 GB and a cluster runs up to three.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.chaos.chaos_harness import mint_key
from tests.vllm.vllm_cluster import CATALOG, SETTINGS, VllmCluster, endpoints
from tests.vllm.vllm_kit import SharedGemma, VllmInstall, describe, require_vllm


@pytest.fixture(scope="session")
def vllm_install() -> VllmInstall:
    return require_vllm()


@pytest.fixture(scope="session")
def shared_gemma(
    vllm_install: VllmInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedGemma]:
    shared = SharedGemma(vllm_install, Path(tmp_path_factory.mktemp("vllm-shared-gemma")))
    yield shared
    shared.close()


@contextlib.contextmanager
def vllm_cluster(install: VllmInstall, root: Path, catalog: str) -> Iterator[tuple[VllmCluster, str]]:
    """The cluster serving ``catalog`` (every model ready before it is yielded) and an API key; stopped
    after, when no vLLM process of it may be left."""
    c = VllmCluster(root, prefix="vllm", settings=dict(SETTINGS), catalog=catalog, install=install)
    t0 = time.monotonic()
    try:
        c.start_nats()
        c.start_controlplane()
        c.start_router()
        c.start_real_agent("node-a", "0")
        c.start_real_agent("node-b", "1")
        key = mint_key(c)
        c.wait_router()
        counts = {str(m["name"]): int(str(m["replicas"])) for m in yaml.safe_load(catalog)["models"]}
        for model, n in counts.items():
            asyncio.run(endpoints(c, model, n))
        print(f"vllm cluster: {counts} serving {time.monotonic() - t0:.1f} s after start")
        yield c, key
    finally:
        c.close()
    left = c.vllm_pids()
    assert not left, f"vLLM processes outlived the cluster: {describe(sorted(left))}"


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest,
    vllm_install: VllmInstall,
    tmp_path_factory: pytest.TempPathFactory,
    shared_gemma: SharedGemma,
) -> Iterator[tuple[VllmCluster, str]]:
    """One cluster per module (its ``CATALOG``), never two at once and never beside the shared gemma:
    each gemma replica takes 5.3 GB."""
    shared_gemma.close()
    catalog = getattr(request.module, "CATALOG", CATALOG)
    with vllm_cluster(vllm_install, Path(tmp_path_factory.mktemp("vllm-cluster")), catalog) as got:
        yield got


@pytest.fixture
async def client(cluster: tuple[VllmCluster, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    c, key = cluster
    oc = openai.AsyncOpenAI(base_url=f"{c.router_url()}/v1", api_key=key, max_retries=0, timeout=180)
    yield oc
    await oc.close()
