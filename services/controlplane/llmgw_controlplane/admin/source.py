"""What the console reads: :class:`ConsoleSource`, and the live one, :class:`CtlApiSource` (the very
handlers that answer ``llmgw ctl``, called in-process, so the console cannot disagree with the CLI)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import nats.errors
from nats.micro.request import ServiceError

from llmgw_common.ctl import (
    DebugStatsReply,
    Empty,
    ExplainReply,
    ModelRequest,
    ModelsReply,
    NodesReply,
    ReplicasReply,
    ReplicasRequest,
    StatusReply,
)
from llmgw_common.errors import Unavailable
from llmgw_common.messages import ClusterSettings
from llmgw_controlplane.console.usage import UsageBook, UsageView

if TYPE_CHECKING:
    from llmgw_controlplane.api import CtlApi


class SourceUnavailable(Unavailable):
    """The control plane could not read its own state (e.g. NATS storage did not answer)."""


class ConsoleSource(Protocol):
    """What the console reads. The service passes :class:`CtlApiSource`; tests pass fixed data.

    Each method may raise :class:`SourceUnavailable`; the page then says so with a 503.
    """

    async def status(self) -> StatusReply: ...
    async def nodes(self) -> NodesReply: ...
    async def models(self) -> ModelsReply: ...
    async def replicas(self) -> ReplicasReply: ...
    async def explain(self, model: str) -> ExplainReply | None:
        """None when ``model`` is not (or no longer) in the catalog."""
        ...

    async def settings(self) -> ClusterSettings: ...
    async def usage(self) -> UsageView | None:
        """None when this control plane does not collect the routers' usage reports."""
        ...

    async def debug_stats(self) -> DebugStatsReply: ...


class CtlApiSource:
    """The live source: the very handlers that answer ``llmgw ctl``, called in-process."""

    def __init__(self, api: CtlApi, usage: UsageBook | None = None) -> None:
        self.api = api
        self.book = usage

    async def status(self) -> StatusReply:
        async with _unavailable("status"):
            return await self.api.status(Empty())

    async def nodes(self) -> NodesReply:
        async with _unavailable("nodes"):
            return await self.api.nodes(Empty())

    async def models(self) -> ModelsReply:
        async with _unavailable("models"):
            return await self.api.models(Empty())

    async def replicas(self) -> ReplicasReply:
        async with _unavailable("replicas"):
            return await self.api.replicas(ReplicasRequest())

    async def explain(self, model: str) -> ExplainReply | None:
        try:
            async with _unavailable("explain-placement"):
                return await self.api.explain(ModelRequest(model=model))
        except ServiceError:
            return None  # left the catalog between the status and this call

    async def settings(self) -> ClusterSettings:
        async with _unavailable("settings"):
            return (await self.api.settings_get(Empty())).settings

    async def usage(self) -> UsageView | None:
        return self.book.view() if self.book is not None else None

    async def debug_stats(self) -> DebugStatsReply:
        async with _unavailable("debug.stats"):
            return await self.api.debug_stats(Empty())


@contextlib.asynccontextmanager
async def _unavailable(what: str) -> Any:
    try:
        yield
    except (nats.errors.Error, TimeoutError) as e:
        raise SourceUnavailable(
            f"{what}: the control plane could not read its state from NATS ({e or type(e).__name__})"
        ) from None
