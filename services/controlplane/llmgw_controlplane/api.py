"""The ``llmgw.ctl`` NATS micro service: one endpoint per verb, typed requests and replies.

Registered only while this process leads (standbys must not answer). Handlers run one at a time per
endpoint, so each does a bounded amount of work on in-memory state plus at most one KV write; errors
the user caused come back as ``ServiceError`` with a description in their terms.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service

from llmgw_common import chunks
from llmgw_common.catalog import CatalogError, catalog_to_yaml, parse_catalog
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.ctl import (
    CatalogApplyReply,
    CatalogDiff,
    CatalogRequest,
    CatalogShowReply,
    DebugStatsReply,
    DrainRequest,
    Empty,
    ExplainReply,
    MarksReply,
    ModelRequest,
    ModelsReply,
    NodeRequest,
    NodesReply,
    ReplicasReply,
    ReplicasRequest,
    SettingsReply,
    SettingsSetRequest,
    StatusReply,
    endpoint_name,
)
from llmgw_common.messages import Marks, Message
from llmgw_common.subjects import Subjects
from llmgw_controlplane import desired, views
from llmgw_controlplane.adapter_views import adapter_explain, adapters_info, with_adapters
from llmgw_controlplane.desired import DesiredConflict
from llmgw_controlplane.scheduler.adapter_book import adapter_demand
from llmgw_controlplane.scheduler.autoscale import Autoscaler, idle_lookup
from llmgw_controlplane.scheduler.placement import explain
from llmgw_controlplane.settings import ControlPlaneSettings
from llmgw_runtime import bus

if TYPE_CHECKING:
    from llmgw_controlplane.desired import DesiredState
    from llmgw_controlplane.failures import FailureBook
    from llmgw_controlplane.pass_verdicts import Verdicts
    from llmgw_controlplane.scheduler.idle import IdleMerger
    from llmgw_controlplane.scheduler.snapshot import Snapshot
    from llmgw_controlplane.state import ClusterState

log = logging.getLogger("llmgw.controlplane.api")
Q = TypeVar("Q", bound=Message)


def _err(code: int, text: str) -> ServiceError:
    return ServiceError(str(code), text)


class CtlReads(Protocol):
    """What the ctl verbs read of the control plane, and nothing more (they change the desired state
    through :class:`DesiredState` only). The service's ``ControlPlane`` is one."""

    @property
    def state(self) -> ClusterState: ...
    @property
    def idle(self) -> IdleMerger: ...
    @property
    def failures(self) -> FailureBook: ...
    @property
    def verdicts(self) -> Verdicts:
        """The last pass's reasons, unplaceable models and crash-loop back-offs."""
        ...

    @property
    def autoscale(self) -> Autoscaler:
        """Scale-to-zero state: cold and waking models, cold starts, evictions (issue 13)."""
        ...

    @property
    def leader(self) -> bool: ...
    @property
    def fence(self) -> int: ...
    def now(self) -> float: ...
    def snapshot(self) -> Snapshot: ...
    def unplaceable_since(self, model: str) -> float | None: ...
    def debug_stats(self) -> DebugStatsReply: ...


class CtlApi:
    def __init__(
        self, reads: CtlReads, desired_state: DesiredState, subjects: Subjects, settings: ControlPlaneSettings
    ) -> None:
        self.reads = reads
        self.desired_state = desired_state
        self.subjects = subjects
        self.settings = settings
        self.service: Service | None = None

    async def start(self, nc: NATS) -> None:
        if self.service is not None:
            return
        subj = self.subjects
        svc = await add_service(nc, name=subj.ctl_service, version="0.1.0", description="llmgw control plane")
        routes: list[tuple[str, type[Message], Callable[[Message], Awaitable[Message]]]] = [
            ("nodes", Empty, self.nodes),
            ("replicas", ReplicasRequest, self.replicas),  # type: ignore[list-item]
            ("models", Empty, self.models),
            ("status", Empty, self.status),
            ("explain-placement", ModelRequest, self.explain),  # type: ignore[list-item]
            ("catalog.apply", CatalogRequest, self.catalog_apply),  # type: ignore[list-item]
            ("catalog.diff", CatalogRequest, self.catalog_diff),  # type: ignore[list-item]
            ("catalog.show", Empty, self.catalog_show),
            ("cordon", NodeRequest, self.cordon),  # type: ignore[list-item]
            ("uncordon", NodeRequest, self.uncordon),  # type: ignore[list-item]
            ("drain", DrainRequest, self.drain),  # type: ignore[list-item]
            ("settings.get", Empty, self.settings_get),
            ("settings.set", SettingsSetRequest, self.settings_set),  # type: ignore[list-item]
            ("debug.stats", Empty, self.debug_stats),
        ]
        for verb, req_cls, fn in routes:
            await svc.add_endpoint(
                name=endpoint_name(verb), subject=subj.ctl(verb), handler=_wrap(verb, req_cls, fn, nc)
            )
        self.service = svc
        await bus.flush(nc)  # the endpoints answer from here on

    async def stop(self) -> None:
        svc, self.service = self.service, None
        if svc is not None:
            try:
                await svc.stop()
            except nats.errors.Error as e:
                log.debug("ctl service stop: %s", e)

    # ------------------------------------------------------------ read verbs

    async def nodes(self, _: Message) -> NodesReply:
        r = self.reads
        return NodesReply(nodes=views.nodes_info(r.state, r.snapshot()))

    async def replicas(self, req: ReplicasRequest) -> ReplicasReply:
        r = self.reads
        snap = r.snapshot()
        rows = views.replicas_info(r.state, snap, r.idle, req.model)
        return ReplicasReply(
            replicas=with_adapters(rows, snap, r.autoscale.adapters),
            failed=r.failures.replicas(snap.now, req.model),
        )

    async def models(self, _: Message) -> ModelsReply:
        r = self.reads
        snap = r.snapshot()
        v = r.verdicts
        models = views.models_info(snap, v.reasons, v.unplaceable, v.backoff)
        load = r.autoscale.load_info(v.unplaceable)
        cache = r.autoscale.demand.cache(snap.now)
        models = tuple(
            m.model_copy(update={"scaling": load.get(m.name), "cache": cache.get(m.name)})
            if m.name in load or m.name in cache
            else m
            for m in models
        )
        requests = adapter_demand(r.autoscale.demand.merged(snap.now), snap.catalog)
        return ModelsReply(
            models=r.failures.on_models(models, snap.now),
            adapters=adapters_info(snap, r.autoscale.adapters, requests),
        )

    async def status(self, _: Message) -> StatusReply:
        r = self.reads
        snap = r.snapshot()
        v = r.verdicts
        models = views.models_info(snap, v.reasons, v.unplaceable, v.backoff)
        settings = await self.desired_state.read_settings()
        reply = views.status_info(
            r.state,
            snap,
            r.idle,
            models=models,
            unplaceable=v.unplaceable,
            unplaceable_since={m: t for m in v.unplaceable if (t := r.unplaceable_since(m)) is not None},
            settings=settings,
            idle_threshold_s=self.settings.idle_threshold_s,
            leader=r.leader,
            fence=r.fence,
            catalog_version=r.state.catalog_version,
        )
        return reply.model_copy(update=r.autoscale.status(v.unplaceable))

    async def explain(self, req: ModelRequest) -> ExplainReply:
        r = self.reads
        profile = r.state.catalog.get(req.model)
        adapter = r.state.catalog.adapter(req.model)
        if adapter is not None:
            return adapter_explain(r.snapshot(), r.autoscale.adapters, adapter)
        if profile is None:
            known = ", ".join(r.state.catalog.names + r.state.catalog.adapter_names) or "none"
            raise _err(404, f"model {req.model!r} is not in the catalog (models and adapters: {known})")
        snap = r.snapshot()
        reply = views.explain_info(explain(profile, snap))
        reply = reply.model_copy(update={"scaling": r.autoscale.explain_scaling(req.model)})
        if reply.placeable:
            return reply
        # What eviction would make room (issue 13): said here, placement itself knows nothing of it.
        why = r.autoscale.explain(profile, snap, idle_lookup(r.idle, snap.now))
        return reply.model_copy(update={"eviction": why})

    async def debug_stats(self, _: Message) -> DebugStatsReply:
        return self.reads.debug_stats()

    # ------------------------------------------------------------ catalog

    def _parse(self, text: str):  # type: ignore[no-untyped-def]
        try:
            return parse_catalog(text)
        except CatalogError as e:
            raise _err(400, f"catalog refused, the current one stays. {e}") from None

    async def catalog_diff(self, req: CatalogRequest) -> CatalogDiff:
        return views.catalog_diff(self.reads.state.catalog, self._parse(req.yaml))

    async def catalog_apply(self, req: CatalogRequest) -> CatalogApplyReply:
        new = self._parse(req.yaml)
        old, version = await self.desired_state.apply_catalog(new)
        # Against what the write replaced: another writer may have stored a catalog since we last read one.
        return CatalogApplyReply(version=version, diff=views.catalog_diff(old, new))

    async def catalog_show(self, _: Message) -> CatalogShowReply:
        st = self.reads.state
        return CatalogShowReply(
            version=st.catalog_version, catalog=st.catalog, yaml=catalog_to_yaml(st.catalog)
        )

    # ------------------------------------------------------------ marks

    def _known(self, node: str) -> None:
        if node not in self.reads.state.nodes:
            raise _err(404, f"no node named {node!r} has reported (`llmgw ctl nodes` lists them)")

    async def cordon(self, req: NodeRequest) -> MarksReply:
        self._known(req.node)
        return await self._marks(req.node, desired.cordon(req.node))

    async def uncordon(self, req: NodeRequest) -> MarksReply:
        self._known(req.node)
        return await self._marks(req.node, desired.uncordon(req.node))

    async def drain(self, req: DrainRequest) -> MarksReply:
        self._known(req.node)
        grace = self.settings.drain_grace_s if req.grace_s is None else req.grace_s
        if grace < 0:
            raise _err(400, f"drain grace must not be negative (got {grace:g}s)")
        return await self._marks(req.node, desired.drain(req.node, self.reads.now() + grace))

    async def _marks(self, node: str, change: Callable[[Marks | None], Marks]) -> MarksReply:
        # Verbs run concurrently (one handler per endpoint): the change applies to the stored marks.
        return MarksReply(node=node, marks=await self.desired_state.change_marks(change))

    # ------------------------------------------------------------ settings

    async def settings_get(self, _: Message) -> SettingsReply:
        return SettingsReply(settings=await self.desired_state.read_settings())

    async def settings_set(self, req: SettingsSetRequest) -> SettingsReply:
        await self.desired_state.store_settings(req.settings)
        return SettingsReply(settings=req.settings)


def _wrap(
    verb: str, req_cls: type[Q], fn: Callable[[Q], Awaitable[Message]], nc: NATS
) -> Callable[[Request], Awaitable[None]]:
    async def handler(req: Request) -> None:
        try:
            msg = decode(req.data, req_cls)
        except DecodeError as e:
            raise _err(400, f"unreadable {verb} request: {e}") from None
        try:
            reply = await fn(msg)
        except ServiceError as e:
            # Headers hold one line; the body carries the full text (a catalog's problems, one a line).
            one_line = " ".join(e.description.split())
            await req.respond_error(e.code, one_line, data=e.description.encode())
            return
        except DesiredConflict as e:
            raise _err(409, f"{verb}: {e}") from None
        except (nats.errors.Error, TimeoutError) as e:
            raise _err(
                503, f"{verb}: the control plane could not reach NATS storage ({e}); try again"
            ) from None
        await _respond(req, encode(reply), nc.max_payload)

    return handler


async def _respond(req: Request, data: bytes, max_payload: int) -> None:
    """One message when it fits the server's max_payload, else numbered chunks (``chunks.py``)."""
    try:
        parts = chunks.split(data, max_payload)
    except ValueError as e:
        await req.respond_error("500", f"the answer is too large to send: {e}")
        return
    if len(parts) == 1:
        await req.respond(data)
        return
    for i, part in enumerate(parts, 1):
        await req.respond(part, headers=chunks.header(i, len(parts)))
