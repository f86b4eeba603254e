"""What the agents' load reports say of each replica's LoRA adapters (issue 33), kept per replica.

Pure bookkeeping, time as arguments: :meth:`AdapterReports.add` takes a node's
:class:`~llmgw_common.messages.LoadReport` (shard 0's line carries the adapters), and
:meth:`AdapterReports.seen` gives what is fresh at ``now``. A replica whose node stopped reporting is
forgotten after ``stale_s``: its adapters are then not known loaded (a request is not sent to a replica
the control plane cannot vouch for), and not known busy either, which never makes them unloadable
sooner (an adapter is unloaded only after being unwanted for a while, see :mod:`adapters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from llmgw_common.messages import LoadReport

# Adapters one replica's line may name, and characters of one error: a forger must not grow our tables.
MAX_ADAPTERS = 1024
MAX_ERROR = 500


def _no_errors() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class AdapterSeen:
    """One replica's adapters as its node last reported them."""

    node: str
    at: float
    loaded: frozenset[str] = frozenset()
    busy: frozenset[str] = frozenset()
    errors: Mapping[str, str] = field(default_factory=_no_errors)
    # The engine's requests running and waiting (None: not reported): the load a choice weighs.
    load: float | None = None


class AdapterReports:
    """Each replica's newest adapter report, by our own clock."""

    def __init__(self, stale_s: float = 10.0) -> None:
        self.stale_s = stale_s
        self._seen: dict[str, AdapterSeen] = {}
        # Reports that changed something (a wake's answer reused while this and the tables stand).
        self.changes = 0

    def add(self, rep: LoadReport, received_at: float) -> bool:
        """Take a node's report; True when a replica's loaded adapters or errors changed (worth a pass)."""
        changed = False
        for line in rep.replicas:
            if line.shard != 0:
                continue
            loaded = frozenset(line.adapters[:MAX_ADAPTERS])
            errors = {
                k: v[:MAX_ERROR]
                for k, v in list(line.adapter_errors.items())[:MAX_ADAPTERS]
                if k not in loaded
            }
            parts = [x for x in (line.running, line.waiting) if x is not None]
            new = AdapterSeen(
                node=rep.node,
                at=received_at,
                loaded=loaded,
                busy=frozenset(line.adapters_busy[:MAX_ADAPTERS]),
                errors=MappingProxyType(errors),
                load=sum(parts) if parts else None,
            )
            old = self._seen.get(line.replica_id)
            if old is None or old.loaded != new.loaded or dict(old.errors) != errors:
                changed = changed or bool(
                    loaded or errors or (old is not None and (old.loaded or old.errors))
                )
            self._seen[line.replica_id] = new
        self.changes += changed
        return changed

    def seen(self, now: float) -> Mapping[str, AdapterSeen]:
        """Replica id -> its fresh report; stale ones are forgotten."""
        for rid in [r for r, s in self._seen.items() if now - s.at > self.stale_s]:
            del self._seen[rid]
        return MappingProxyType(dict(self._seen))
