"""The vLLM tests' inputs: the ``make vllm`` install (skipped, saying what is missing, without it) and
the session's one llmgw cluster around real vLLM (vllm_stage.py: nats-server, a control plane, a router
and two agents, nodes ``node-a`` and ``node-b``, a core each), brought to each test's catalog (the
``vllm_catalog`` marker, else the module's ``CATALOG``; default: gemma on two replicas and minilm on
one, vLLM's response store on).

The modules run on one worker (the ``vllm`` xdist group), in name order, which is the order of what
they need: ``api_fidelity`` and ``api_sdks`` ask the default catalog's engines directly and through
the router; ``argv`` needs no cluster; ``cache_routing`` sends conversations through the router on the
default catalog; ``cluster`` starts on the default catalog, fails two starts,
then takes minilm away; ``cluster_lifecycle`` drains and wakes on gemma alone; ``failover`` SIGKILLs a
gemma last, so the replacement's start is one nobody waits for; ``kv_prediction`` runs a vLLM of its own
(the router's predicted blocks against the events vLLM publishes); ``lora`` brings gemma alone with LoRA
on and two adapters (one more start, and nothing after it needs the default catalog). ``tracing``, last by name, runs a
vLLM of its own (traced to Arize Phoenix), whatever the stage holds. Every start saved is 30-100 s of both
cores (a vLLM start here is about 55 s of CPU, a 4-token chat about 0.45 s).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import openai
import pytest

from tests.vllm.vllm_cluster import CATALOG, VllmCluster
from tests.vllm.vllm_kit import VllmInstall, require_vllm
from tests.vllm.vllm_stage import ClusterStage


@pytest.fixture(scope="session")
def vllm_install() -> VllmInstall:
    return require_vllm()


@pytest.fixture(scope="session")
def vllm_stage(vllm_install: VllmInstall, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStage]:
    stage = ClusterStage(vllm_install, lambda: Path(tmp_path_factory.mktemp("vllm-cluster")))
    try:
        yield stage
    finally:
        stage.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    stage = funcargs.get("vllm_stage")
    # What a failed test that drove the cluster (its `cluster` fixture) left on it is unknown: the next
    # test gets a new one. A test that only asked its engines (the fidelity modules) changed nothing.
    if report.failed and isinstance(stage, ClusterStage) and "cluster" in funcargs:
        stage.spoiled = True
    return report


@pytest.fixture
def cluster(request: pytest.FixtureRequest, vllm_stage: ClusterStage) -> tuple[VllmCluster, str]:
    """The stage serving this test's catalog."""
    marker = request.node.get_closest_marker("vllm_catalog")
    catalog = str(marker.args[0]) if marker is not None else getattr(request.module, "CATALOG", CATALOG)
    waits = request.node.get_closest_marker("vllm_waits_for")
    return vllm_stage.serve(catalog, None if waits is None else [str(m) for m in waits.args])


@pytest.fixture
async def client(cluster: tuple[VllmCluster, str]) -> AsyncIterator[openai.AsyncOpenAI]:
    c, key = cluster
    oc = openai.AsyncOpenAI(base_url=f"{c.router_url()}/v1", api_key=key, max_retries=0, timeout=180)
    yield oc
    await oc.close()
