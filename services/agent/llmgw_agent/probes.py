"""What the supervisor asks an engine over HTTP: is it healthy, and has it finished what it holds."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from llmgw_agent.engines import LaunchSpec
from llmgw_agent.metrics import extract_load, parse_prometheus

log = logging.getLogger("llmgw.agent.supervisor")


class Probes:
    """One HTTP client for every engine of the node; ``aclose()`` it with the supervisor."""

    def __init__(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def healthy(self, url: str, timeout: float | None = None) -> str | None:
        """None when healthy, else why not (``timeout``: instead of the client's)."""
        try:
            r = await self._http.get(url, timeout=self._http.timeout if timeout is None else timeout)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}"
        return None if r.status_code == 200 else f"HTTP {r.status_code}"

    async def quiesce(self, spec: LaunchSpec, quiesce_s: float, what: str, every: float = 0.2) -> None:
        """Until the engine reports nothing running or waiting twice in a row, or ``quiesce_s`` passed.

        Returns at once when it cannot tell: no metrics, a scrape that fails (the engine is gone), or an
        engine that does not expose a running count. ``what``: the shard, for the log.
        """
        if spec.metrics_url is None:
            return
        deadline = time.monotonic() + quiesce_s
        quiet = 0
        while True:
            try:
                r = await self._http.get(spec.metrics_url)
                r.raise_for_status()
            except httpx.HTTPError:
                return
            load = extract_load(parse_prometheus(r.text), spec.metrics)
            if load.running is None:
                return
            quiet = quiet + 1 if load.running == 0 and not load.waiting else 0
            if quiet >= 2:
                return
            if time.monotonic() >= deadline:
                log.info(
                    "stopping %s with %g request(s) still running after %gs", what, load.running, quiesce_s
                )
                return
            await asyncio.sleep(every)
