"""What agents relay of their engines' KV caches, heard on the bus as a router hears it: the node's
``KvDeltas`` kept in order, and the block keys each replica holds after them."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from llmgw_common.codec import decode
from llmgw_common.kvcache import KvDeltas
from llmgw_common.subjects import Subjects


class KvTap:
    def __init__(self) -> None:
        self.deltas: list[KvDeltas] = []

    async def heard(self, msg: Msg) -> None:
        self.deltas.append(decode(msg.data, KvDeltas))

    @classmethod
    async def on(cls, nc: NATS, prefix: str, node: str) -> KvTap:
        tap = cls()
        await nc.subscribe(Subjects(prefix).kv(node), cb=tap.heard)
        await nc.flush()
        return tap

    def entries(self, replica: str) -> list[tuple[bool, bool]]:
        """Each batch's (cleared, gone) for ``replica``, in order."""
        return [(r.cleared, r.gone) for m in self.deltas for r in m.replicas if r.replica == replica]

    def held(self) -> dict[str, set[int]]:
        """Replica -> the block keys it holds after every batch heard (a gone replica is absent)."""
        out: dict[str, set[int]] = {}
        for m in self.deltas:
            for r in m.replicas:
                if r.gone:
                    out.pop(r.replica, None)
                    continue
                ks = out.setdefault(r.replica, set())
                if r.cleared:
                    ks.clear()
                ks |= set(r.stored)
                ks -= set(r.removed)
        return out
