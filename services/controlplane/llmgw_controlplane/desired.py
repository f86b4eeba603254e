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
from typing import Generic, TypeVar

from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from llmgw_common.backoff import jittered_delay
from llmgw_common.bus import DropLog
from llmgw_common.codec import DecodeError, decode, encode
from llmgw_common.errors import Conflict
from llmgw_common.messages import Marks

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
