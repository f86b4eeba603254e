"""Control-plane test helpers: a control plane running in-process against the session's real
nats-server (fake agents are tests.kit.agents)."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyWrongLastSequenceError

from llmgw_common.catalog import parse_catalog
from llmgw_common.codec import encode
from llmgw_common.ctl import StatusReply
from llmgw_common.subjects import Subjects
from llmgw_controlplane.service import ControlPlane
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_runtime import bus
from llmgw_runtime.ctl_client import CtlClient, CtlUnavailable
from tests.kit.poll import eventually

CATALOG = """
models:
  - name: small
    engine: sim
    replicas: 1
    gpu_class: H100-80GB
  - name: cpu-model
    engine: sim
    replicas: 1
"""


# A ctl call's time limit in tests that make several at once: each endpoint's handler runs one request
# at a time (nats.micro) and a write verb does two JetStream round trips (read, compare-and-set), which
# on a loaded 2-core box take up to about half a second each: five queued cordons outlast ctl's 2 s.
CTL_TIMEOUT_S = 30.0


async def ctl_answers(nc: NATS, prefix: str, timeout: float = 15.0) -> StatusReply:
    """Poll ``ctl status`` until a leading control plane answers it, and return that answer.

    Wait on this, not on ``cp.leader``, before a ctl call: the flag flips before the ctl endpoints are
    registered (``_become_leader``), so a call right after it may meet "no responders" (``CtlUnavailable``).
    """

    async def answered() -> StatusReply | None:
        try:
            st = await CtlClient(nc, prefix, timeout=1.0).status()
        except CtlUnavailable:
            return None
        return st if st.leader else None

    got = await eventually(answered, timeout=timeout, what="a leading control plane to answer `ctl status`")
    assert got is not None  # eventually returns only a truthy answer
    return got


def cp_settings(url: str, prefix: str, **over: Any) -> ControlPlaneSettings:
    base: dict[str, Any] = dict(
        nats_urls=[url],
        prefix=prefix,
        tick_s=0.1,
        heartbeat_interval_s=0.2,
        unreachable_after_missed=3,
        node_lost_s=1.5,
        settle_s=0.0,
        lease_ttl_s=1.5,
        admin_port=0,
    )
    base.update(over)
    return ControlPlaneSettings(**base)


class RunningCP:
    def __init__(self, cp: ControlPlane, stop: asyncio.Event, task: asyncio.Task[None], nc: NATS) -> None:
        self.cp = cp
        self.stop_event = stop
        self.task = task
        self.nc = nc

    async def stop(self) -> None:
        self.stop_event.set()
        await self.task
        await self.nc.close()


async def start_cp(
    settings: ControlPlaneSettings,
    catalog_text: str | None = CATALOG,
    holder: str | None = None,
    nc_url: str | None = None,
) -> RunningCP:
    nc = await bus.connect(settings, "cp-test", wait=False)
    cp = ControlPlane(settings, nc, holder=holder)
    if catalog_text is not None and settings.catalog_file is None:
        # Seed the bus with the catalog, as a previous run would have stored it.
        js = nc.jetstream()
        subj = Subjects(settings.prefix)
        kv = await bus.ensure_kv(js, subj.bucket_desired, history=5)
        try:
            await kv.create("catalog", encode(parse_catalog(catalog_text)))
        except KeyWrongLastSequenceError:
            pass
    await cp.start()
    stop = asyncio.Event()
    task = asyncio.create_task(cp.run(stop))
    return RunningCP(cp, stop, task, nc)
