"""What a test waits for and asks of a running chaos cluster (chaos_harness.py) from outside: its
routing table's endpoints, a control plane process up, an API key in its keys bucket."""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING

from llmgw_common.messages import RoutingEndpoints
from llmgw_common.subjects import Subjects
from llmgw_runtime import bus
from llmgw_runtime.routing_rows import read_routing
from llmgw_runtime.settings import BusSettings
from tests.chaos.chaos_bus import BUS_ERRORS
from tests.kit.poll import eventually

if TYPE_CHECKING:
    from tests.chaos.chaos_harness import ChaosCluster, Proc


def holder(p: Proc) -> str:
    """The name a control plane process holds the lease under."""
    return f"{socket.gethostname()}-{p.pid}"


async def controlplane_up(p: Proc, timeout: float = 60.0) -> None:
    """Wait until this control plane process (not an earlier one under its name: the log is appended)
    says it is up. A standby started beside vLLM starts took 11 s to get there in a CI run: a leader
    killed before then is replaced only once the standby's own start is over."""
    line = f" {holder(p)} up on prefix "

    def up() -> bool:
        try:
            return line in p.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False

    try:
        await eventually(up, timeout=timeout, every=0.2, what=f"{p.name} to say it is up")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{p.tail()}") from None


def mint_key(cluster: ChaosCluster, name: str = "chaos") -> str:
    """An API key stored in the cluster's keys bucket (as ``llmgw keys create`` does)."""
    from llmgw_runtime import bus
    from llmgw_runtime.apikeys import create_key
    from llmgw_runtime.settings import BusSettings

    async def main() -> str:
        nc = await bus.connect(BusSettings(nats_urls=[cluster.nats_url], prefix=cluster.prefix), "chaos-key")
        try:
            key, _ = await create_key(nc, cluster.prefix, name)
            return key
        finally:
            await nc.close()

    return asyncio.run(main())


async def routing_table(
    cluster: ChaosCluster, model: str, count: int, timeout: float = 60.0, every: float = 0.2
) -> RoutingEndpoints:
    """The routing table once it lists exactly ``count`` endpoints for ``model``; on a timeout, what it
    said of the model last, and the cluster's diagnostics."""
    nc = await bus.connect(BusSettings(nats_urls=[cluster.nats_url], prefix=cluster.prefix), "test-wait")
    last: RoutingEndpoints | None = None
    try:

        async def listed() -> RoutingEndpoints | None:
            nonlocal last
            # The bucket may not exist yet before the control plane made it (a tolerated bus error).
            kv = await nc.jetstream().key_value(Subjects(cluster.prefix).bucket_routing)
            last = await read_routing(kv)
            return last if last is not None and len(last.endpoints.get(model, ())) == count else None

        try:
            return await eventually(
                listed,
                timeout=timeout,
                every=every,
                what=f"{count} endpoint(s) of {model}",
                tolerate=BUS_ERRORS,
            )
        except AssertionError as e:
            if last is None:
                said = "no table"
            else:
                nodes = [ep.node for ep in last.endpoints.get(model, ())]
                said = f"listed on {nodes}; {last.unavailable.get(model, '')}"
            raise AssertionError(f"{e} ({said})\n{cluster.diagnostics()}") from None
    finally:
        await nc.close()


def wait_endpoints(cluster: ChaosCluster, model: str, count: int, timeout: float = 60.0) -> list[str]:
    """Wait until the routing table lists ``count`` endpoints for ``model``; their nodes."""
    table = asyncio.run(routing_table(cluster, model, count, timeout))
    return [e.node for e in table.endpoints[model]]
