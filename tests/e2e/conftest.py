"""One real `llmgw up` for the whole e2e session, shared by every e2e test.

It runs as a real ``python -m llmgw_cli up`` process in a temporary data directory, on free ports,
with its own embedded NATS. The fixture waits until `up` reports a chat completion went through
(``<data-dir>/up.json`` with ``ready: true``), then yields what a client needs.

Tests that stop a cluster start their own (see ``test_e2e_shutdown.py``), so no test depends on order.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.e2e_cluster import Cluster, start_up, stop_up


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_up(tmp_path_factory.mktemp("e2e") / "data")
    yield c
    stop_up(c)
