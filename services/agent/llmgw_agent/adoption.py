"""Whether an engine re-adopted after an agent restart is ready the moment it is adopted.

It was serving when the previous agent died, and the routers still send it traffic. Reported
``starting`` until its first health check, it would leave the routing endpoints for up to a health
interval: a watched model with one replica would get model.down, then model.recovered. So it is asked
once, briefly, before it is first reported; one that does not answer at once is ``starting`` and judged
as a new engine is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from llmgw_agent.engines import LaunchSpec

# A healthy engine on this host answers in milliseconds; a longer wait only delays the first heartbeat.
ADOPT_HEALTH_TIMEOUT_S = 0.5

# (url, timeout) -> None when healthy, else why not.
HealthCheck = Callable[[str, float], Awaitable[str | None]]


async def ready_at_adoption(spec: LaunchSpec, age_s: float, settle_s: float, healthy: HealthCheck) -> bool:
    """True when the adopted engine (started ``age_s`` ago) answers its health check now.

    A headless engine (a multi-node follower) has nothing to ask: a new one is ready once it has lived
    ``settle_s``, and this one is alive (the state file's PID and start time matched).
    """
    if spec.health_url is None:
        return age_s >= settle_s
    return await healthy(spec.health_url, ADOPT_HEALTH_TIMEOUT_S) is None
