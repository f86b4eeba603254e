"""The one writer of ``<prefix>_desired``: every change is a pure function of the stored value, applied
by compare-and-set and retried when someone else wrote in between.

Handlers of different ctl verbs run concurrently, a deposed leader may still finish a verb, and
``llmgw setup`` writes settings from outside: a read-modify-write from this process's memory would let
the last writer silently drop the others' marks. Here the base is always what is stored, and a write
lands only on the revision it was computed from.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from llmgw_common.backoff import jittered_delay
from llmgw_common.catalog import Catalog, load_catalog_file
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.errors import Conflict
from llmgw_common.messages import ClusterSettings, Marks
from llmgw_common.subjects import DESIRED_CATALOG, DESIRED_MARKS, DESIRED_SETTINGS
from llmgw_controlplane.pass_requests import PassReason, PassRequests
from llmgw_runtime import bus
from llmgw_runtime.bus import DropLog

if TYPE_CHECKING:
    from llmgw_controlplane.routing_publisher import RoutingPublisher
    from llmgw_controlplane.state import ClusterState

log = logging.getLogger("llmgw.controlplane.desired")
M = TypeVar("M", bound=BaseModel)

ATTEMPTS = 10
BACKOFF_S = 0.01
BACKOFF_MAX_S = 0.2


class DesiredConflict(Conflict):
    """The key kept changing between our read and our write: nothing was written."""


@dataclass(frozen=True, slots=True)
class Changed(Generic[M]):
    old: M | None
    new: M
    # The key's revision holding ``new``: concurrent changes finish in any order, the revision says
    # which value is the latest.
    revision: int


class DesiredStore:
    """Compare-and-set changes of the keys of ``<prefix>_desired``."""

    def __init__(
        self,
        kv: KeyValue,
        drops: DropLog,
        *,
        attempts: int = ATTEMPTS,
        backoff_s: float = BACKOFF_S,
        rng: random.Random | None = None,
    ) -> None:
        self.kv = kv
        self.drops = drops
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.rng = rng or random.Random()
        self.conflicts = 0
        # This process's changes of one key take turns: racing each other they would only lose
        # attempts (forty concurrent verbs left one without a win in ten on a busy machine).
        self._turns: dict[str, asyncio.Lock] = {}

    async def read(self, key: str, cls: type[M]) -> tuple[M | None, int]:
        """The stored value (None when absent, deleted or unreadable) and the revision to write on (0: none)."""
        try:
            e = await self.kv.get(key)
        except NotFoundError:  # absent, or deleted (KeyDeletedError is not a KeyNotFoundError)
            return None, 0
        rev = e.revision or 0
        if e.value is None:
            return None, rev
        try:
            return decode(e.value, cls), rev
        except DecodeError as err:
            # An unreadable value is replaced, on its revision, rather than merged into.
            self.drops.drop(f"{self.kv._name}/{key}", str(err))
            return None, rev

    async def change(self, key: str, cls: type[M], fn: Callable[[M | None], M]) -> Changed[M]:
        """Store ``fn(current)``; returns what it replaced, what is stored now, and its revision.

        ``fn`` must be pure: it runs again on the newer value after a lost race. A result equal to the
        current value writes nothing. Raises :class:`DesiredConflict` after ``attempts`` lost races.
        """
        async with self._turns.setdefault(key, asyncio.Lock()):
            return await self._change(key, cls, fn)

    async def _change(self, key: str, cls: type[M], fn: Callable[[M | None], M]) -> Changed[M]:
        for attempt in range(self.attempts):
            current, rev = await self.read(key, cls)
            new = fn(current)
            if current is not None and new == current:
                return Changed(current, current, rev)
            try:
                if rev:
                    written = await self.kv.update(key, encode(new), last=rev)
                else:
                    # create() also takes the key over a delete marker; it fails if anyone created it first.
                    written = await self.kv.create(key, encode(new))
                return Changed(current, new, written)
            except KeyWrongLastSequenceError:
                self.conflicts += 1
                await asyncio.sleep(
                    jittered_delay(attempt + 1, self.backoff_s, BACKOFF_MAX_S, self.rng.random())
                )
        raise DesiredConflict(
            f"{key} in {self.kv._name} changed under every one of {self.attempts} attempts "
            "(other writers are busy); nothing was changed, try again"
        )


class DesiredState:
    """The desired state as this process holds it: read from ``<prefix>_desired`` at start and takeover,
    changed by ctl verbs through :class:`DesiredStore`, and mirrored into the tables the loop reads."""

    def __init__(
        self,
        kv: KeyValue,
        store: DesiredStore,
        *,
        state: ClusterState,
        routing: RoutingPublisher,
        passes: PassRequests,
        drops: DropLog,
    ) -> None:
        self.kv = kv
        self.store = store
        self.state = state
        self.routing = routing
        self.passes = passes
        self.drops = drops
        self._marks_revision = 0

    async def load_catalog(self, catalog_file: str | None) -> None:
        """The bus's catalog if there is one, else the file's (stored). Raises :class:`CatalogError` for
        an invalid file."""
        stored, _ = await bus.kv_get(self.kv, DESIRED_CATALOG, Catalog, self.drops)
        if stored is not None:
            self.state.set_catalog(stored, 1)
            log.info("catalog from %s: %d model(s)", self.kv._name, len(stored.models))
            return
        if not catalog_file:
            log.warning("no catalog in %s and no catalog file: serving nothing", self.kv._name)
            return
        cat = load_catalog_file(catalog_file)
        # If another control plane stored one meanwhile, that one is the desired state.
        cat = (await self.store.change(DESIRED_CATALOG, Catalog, lambda cur: cat if cur is None else cur)).new
        self.state.set_catalog(cat, 1)
        log.info("catalog from %s: %d model(s)", catalog_file, len(cat.models))

    async def reload_catalog(self) -> None:
        """Take the stored catalog when it differs from ours (a takeover: another leader may have changed it)."""
        stored, _ = await bus.kv_get(self.kv, DESIRED_CATALOG, Catalog, self.drops)
        if stored is not None and stored != self.state.catalog:
            self.state.set_catalog(stored, self.state.catalog_version + 1)

    async def load_marks(self) -> None:
        marks, self._marks_revision = await bus.kv_get(self.kv, DESIRED_MARKS, Marks, self.drops)
        self.state.marks = marks or Marks()

    async def apply_catalog(self, catalog: Catalog) -> tuple[Catalog, int]:
        """Store ``catalog``; returns the one it replaced (as stored, not as this process last saw it)."""
        old = (await self.store.change(DESIRED_CATALOG, Catalog, lambda _: catalog)).old
        self.state.set_catalog(catalog, self.state.catalog_version + 1)
        await self.routing.publish_catalog(catalog)
        log.info("catalog v%d applied: %d model(s)", self.state.catalog_version, len(catalog.models))
        self.passes.request(PassReason.DESIRED)
        return old or Catalog(), self.state.catalog_version

    async def change_marks(self, change: Callable[[Marks | None], Marks]) -> Marks:
        """Apply ``change`` (pure) to the stored marks, compare-and-set; returns the marks now stored."""
        ch = await self.store.change(DESIRED_MARKS, Marks, change)
        if ch.revision >= self._marks_revision:
            # Verbs finish in any order: never step back to a value an overlapping verb has superseded.
            self._marks_revision = ch.revision
            self.state.marks = ch.new
        self.passes.request(PassReason.DESIRED)
        return ch.new

    async def read_settings(self) -> ClusterSettings:
        cur, _ = await bus.kv_get(self.kv, DESIRED_SETTINGS, ClusterSettings, self.drops)
        return cur or ClusterSettings()

    async def store_settings(self, settings: ClusterSettings) -> None:
        await self.store.change(DESIRED_SETTINGS, ClusterSettings, lambda _: settings)


# ---------------------------------------------------------------- marks, as pure functions of the stored ones


def cordon(node: str) -> Callable[[Marks | None], Marks]:
    def f(m: Marks | None) -> Marks:
        m = m or Marks()
        return m.model_copy(update={"cordoned": tuple(sorted({*m.cordoned, node}))})

    return f


def uncordon(node: str) -> Callable[[Marks | None], Marks]:
    """Lifts both marks: a node uncordoned is not draining either."""

    def f(m: Marks | None) -> Marks:
        m = m or Marks()
        return Marks(
            cordoned=tuple(n for n in m.cordoned if n != node),
            draining={k: v for k, v in m.draining.items() if k != node},
        )

    return f


def drain(node: str, deadline: float) -> Callable[[Marks | None], Marks]:
    def f(m: Marks | None) -> Marks:
        m = m or Marks()
        return m.model_copy(update={"draining": {**m.draining, node: deadline}})

    return f
