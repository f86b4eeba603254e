"""One real `llmgw up` for the whole e2e session, shared by every e2e test.

It runs as a real ``python -m llmgw_cli up`` process in a temporary data directory, on free ports,
with its own embedded NATS. The fixture waits until `up` reports a chat completion went through
(``<data-dir>/up.json`` with ``ready: true``), then yields what a client needs.

Tests that stop the cluster are marked ``e2e_last`` and run after all others.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_cluster import Cluster, start_up, stop_up


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e_last: stops the shared cluster; runs after every other e2e test")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda it: it.get_closest_marker("e2e_last") is not None)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_up(tmp_path_factory.mktemp("e2e") / "data")
    yield c
    stop_up(c)
