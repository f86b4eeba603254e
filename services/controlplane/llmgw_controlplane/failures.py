"""Failed replicas, kept for a while after they were stopped, so that `llmgw ctl` can still say why.

The reconciler stops a failed replica on the pass that sees it fail, and its record, shard reports and
log tails go with it: without this book the error is visible for one tick. Kept: the last ``max_kept``
failed replicas and the last failure of each model, each for ``retention_s``; engine log tails are
clipped, so memory and the size of a ctl reply stay bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from llmgw_common.ctl import ModelInfo, ReplicaInfo
from llmgw_common.messages import ReplicaRecord
from llmgw_controlplane.state import ClusterState
from llmgw_controlplane.views import shard_infos

RETENTION_S = 900.0
MAX_KEPT = 32
TAIL_LINES = 20
LINE_CHARS = 240

FAILED_PREFIX = "failed: "


def failed_replica(state: ClusterState, rec: ReplicaRecord, reason: str, now: float) -> ReplicaInfo:
    """The replica as it was when it was stopped for failing (call before its record is dropped)."""
    shards = tuple(
        s.model_copy(update={"log_tail": tuple(line[:LINE_CHARS] for line in s.log_tail[-TAIL_LINES:])})
        for s in shard_infos(state, state.replica_view(rec))
    )
    return ReplicaInfo(
        id=rec.id,
        model=rec.model,
        state="failed",
        created=rec.created,
        shards=shards,
        error=reason.removeprefix(FAILED_PREFIX),
        failed_at=now,
    )


class FailureBook:
    def __init__(self, retention_s: float = RETENTION_S, max_kept: int = MAX_KEPT) -> None:
        self.retention_s = retention_s
        self.max_kept = max_kept
        # replica id -> its failure, oldest first.
        self._replicas: OrderedDict[str, ReplicaInfo] = OrderedDict()
        self._models: OrderedDict[str, ReplicaInfo] = OrderedDict()

    def add(self, info: ReplicaInfo) -> None:
        for table, key in ((self._replicas, info.id), (self._models, info.model)):
            table.pop(key, None)
            table[key] = info
            while len(table) > self.max_kept:
                table.popitem(last=False)

    def _fresh(self, info: ReplicaInfo, now: float) -> bool:
        return info.failed_at is not None and now - info.failed_at < self.retention_s

    def prune(self, now: float) -> None:
        for table in (self._replicas, self._models):
            for key in [k for k, v in table.items() if not self._fresh(v, now)]:
                del table[key]

    def replicas(self, now: float, model: str | None = None) -> tuple[ReplicaInfo, ...]:
        """Newest first."""
        self.prune(now)
        return tuple(v for v in reversed(self._replicas.values()) if model is None or v.model == model)

    def last(self, model: str, now: float) -> ReplicaInfo | None:
        info = self._models.get(model)
        return info if info is not None and self._fresh(info, now) else None

    def on_models(self, models: Iterable[ModelInfo], now: float) -> tuple[ModelInfo, ...]:
        """``models`` with each one's last failure, where one is kept."""
        return tuple(
            m if (f := self.last(m.name, now)) is None else m.model_copy(update={"last_failure": f})
            for m in models
        )
