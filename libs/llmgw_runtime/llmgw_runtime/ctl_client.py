"""The management API's client: one method per ``llmgw.ctl.<verb>`` (the types are :mod:`llmgw_common.ctl`).

:class:`CtlClient` turns an error reply into :class:`CtlError` with the control plane's user-facing
description, and a silent bus into :class:`CtlUnavailable`. A reply larger than the server's max_payload
arrives in numbered parts (:mod:`llmgw_common.chunks`) and is joined.
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_common import chunks
from llmgw_common.codec import MAX_PAYLOAD, DecodeError, decode, encode
from llmgw_common.ctl import (
    ERROR_CODE_HEADER,
    ERROR_HEADER,
    NO_RESPONDERS,
    STATUS_HEADER,
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
)
from llmgw_common.errors import LlmgwError, Unavailable
from llmgw_common.messages import ClusterSettings, Message
from llmgw_common.subjects import Subjects


class CtlError(LlmgwError):
    """The control plane answered with an error; ``message`` is meant for the user."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class CtlUnavailable(CtlError, Unavailable):
    """No control plane answered."""


R = TypeVar("R", bound=Message)


class CtlClient:
    """One method per ctl verb. Raises :class:`CtlError`, or :class:`CtlUnavailable` when none answers."""

    def __init__(self, nc: NATS, prefix: str = "llmgw", timeout: float = 2.0) -> None:
        self.nc = nc
        self.subjects = Subjects(prefix)
        self.timeout = timeout

    async def call(self, verb: str, request: Message, reply_cls: type[R], timeout: float | None = None) -> R:
        subject = self.subjects.ctl(verb)
        wait = self.timeout if timeout is None else timeout
        # Its own inbox rather than nc.request(): a large answer comes as several messages (chunks.py).
        sub = await self.nc.subscribe(self.nc.new_inbox())
        try:
            await self.nc.publish(subject, encode(request), reply=sub.subject)
            msg = await self._next(sub, wait, subject)
            headers = msg.headers or {}
            if headers.get(STATUS_HEADER) == NO_RESPONDERS:
                raise self._not_served(subject)
            if ERROR_HEADER in headers:
                # The body, when present, is the full (multi-line) description; the header is one line.
                text = msg.data.decode("utf-8", "replace") if msg.data else headers[ERROR_HEADER]
                raise CtlError(text, headers.get(ERROR_CODE_HEADER, ""))
            data = msg.data
            if chunks.CHUNK_HEADER in headers:
                data = await self._rest(sub, msg, wait, verb)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        try:
            return decode(data, reply_cls, limit=max(len(data), MAX_PAYLOAD))
        except DecodeError as e:
            raise CtlError(f"the control plane's reply to {verb} could not be read: {e}") from None

    async def _next(self, sub: Subscription, wait: float, subject: str) -> Msg:
        try:
            return await sub.next_msg(timeout=wait)
        except nats.errors.TimeoutError:
            raise self._unavailable(subject, wait) from None

    async def _rest(self, sub: Subscription, first: Msg, wait: float, verb: str) -> bytes:
        """The remaining chunks of a reply whose first part is ``first``, joined in order."""
        try:
            count = chunks.parse((first.headers or {})[chunks.CHUNK_HEADER], 1, None)
            parts = [first.data]
            for i in range(2, count + 1):
                try:
                    msg = await sub.next_msg(timeout=wait)
                except nats.errors.TimeoutError:
                    raise CtlError(
                        f"the control plane's reply to {verb} stopped after {i - 1} of {count} parts "
                        f"(nothing for {wait:g}s); try again"
                    ) from None
                chunks.parse((msg.headers or {}).get(chunks.CHUNK_HEADER, ""), i, count)
                parts.append(msg.data)
        except chunks.ChunkError as e:
            raise CtlError(f"the control plane's reply to {verb} could not be read: {e}") from None
        return b"".join(parts)

    @staticmethod
    def _not_served(subject: str) -> CtlUnavailable:
        # The server's immediate answer: nobody subscribes (none running, or a takeover in its gap).
        return CtlUnavailable(
            f"no control plane answered on {subject}: none is serving it (is `llmgw controlplane` "
            "running, with the same --nats and --prefix? a standby takes over within a lease TTL)"
        )

    @staticmethod
    def _unavailable(subject: str, wait: float) -> CtlUnavailable:
        return CtlUnavailable(
            f"no control plane answered on {subject} within {wait:g}s "
            "(is `llmgw controlplane` running, with the same --nats and --prefix?)"
        )

    async def nodes(self) -> NodesReply:
        return await self.call("nodes", Empty(), NodesReply)

    async def replicas(self, model: str | None = None) -> ReplicasReply:
        return await self.call("replicas", ReplicasRequest(model=model), ReplicasReply)

    async def models(self) -> ModelsReply:
        return await self.call("models", Empty(), ModelsReply)

    async def status(self) -> StatusReply:
        return await self.call("status", Empty(), StatusReply)

    async def explain_placement(self, model: str) -> ExplainReply:
        return await self.call("explain-placement", ModelRequest(model=model), ExplainReply)

    async def catalog_apply(self, yaml_text: str) -> CatalogApplyReply:
        return await self.call("catalog.apply", CatalogRequest(yaml=yaml_text), CatalogApplyReply)

    async def catalog_diff(self, yaml_text: str) -> CatalogDiff:
        return await self.call("catalog.diff", CatalogRequest(yaml=yaml_text), CatalogDiff)

    async def catalog_show(self) -> CatalogShowReply:
        return await self.call("catalog.show", Empty(), CatalogShowReply)

    async def cordon(self, node: str) -> MarksReply:
        return await self.call("cordon", NodeRequest(node=node), MarksReply)

    async def uncordon(self, node: str) -> MarksReply:
        return await self.call("uncordon", NodeRequest(node=node), MarksReply)

    async def drain(self, node: str, grace_s: float | None = None) -> MarksReply:
        return await self.call("drain", DrainRequest(node=node, grace_s=grace_s), MarksReply)

    async def settings_get(self) -> SettingsReply:
        return await self.call("settings.get", Empty(), SettingsReply)

    async def settings_set(self, settings: ClusterSettings) -> SettingsReply:
        return await self.call("settings.set", SettingsSetRequest(settings=settings), SettingsReply)

    async def debug_stats(self) -> DebugStatsReply:
        return await self.call("debug.stats", Empty(), DebugStatsReply)
