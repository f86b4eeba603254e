"""The routing table as one KV entry per model (issue 35), and its fold back into ``RoutingEndpoints``.

Before, the table was one value, ``endpoints`` in ``<prefix>_routing``, rewritten whole on every change:
2.8 MB at 20,000 endpoints (past NATS's 1 MB ``max_payload`` at about 7,000), and every router read all
of it per change. Now each model has its row, key ``model.<name>`` (:func:`row_key`), written only when
that model's endpoints or state change; a model that leaves the table has its row deleted. The key
``head`` says a table exists (a control plane has published one, empty or not) and carries the
format; it is written with the first table, after its rows, not per change.

Every row carries the table's version at its last write: versions grow across rows, so a reader's
version is the largest it has seen. A reader folds the rows it holds into a ``RoutingEndpoints``
(:class:`RowFold`); the legacy ``endpoints`` key, whole, is still understood (static writers, older
control planes) and then stands for the whole table.
"""

from __future__ import annotations

import re

from llmgw_common.codec import decode
from llmgw_common.messages import Endpoint, Message, RoutingEndpoints
from llmgw_common.subjects import ROUTING_ENDPOINTS

ROUTING_HEAD = "head"
ROW_PREFIX = "model."
# The format of the rows: a reader that finds a larger one in the head knows it is older.
ROWS_FORMAT = 1

# Characters a model name may have that a KV key may not, or that would split it into subject tokens.
_ESCAPE = re.compile(r"[^A-Za-z0-9_/-]")
_UNESCAPE = re.compile(r"=([0-9a-f]{2})")


def row_key(model: str) -> str:
    """The KV key of ``model``'s row: ``model.`` then the name with ``.``, ``:`` (and ``=``) written
    ``=2e``, ``=3a`` (``=3d``): one subject token after the prefix, reversible."""
    return ROW_PREFIX + _ESCAPE.sub(lambda m: f"={ord(m.group()):02x}", model)


def row_model(key: str) -> str | None:
    """The model of a row key; None for any other key of the bucket."""
    if not key.startswith(ROW_PREFIX):
        return None
    return _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), key[len(ROW_PREFIX) :])


class ModelRouting(Message):
    """One model's row of the routing table: key ``model.<name>`` in ``<prefix>_routing``."""

    version: int
    model: str
    endpoints: tuple[Endpoint, ...] = ()
    # The fields of ``RoutingEndpoints`` for this model: why it has no ready endpoint, what is coming,
    # scaled to zero.
    unavailable: str | None = None
    coming: str | None = None
    cold: bool = False


class RoutingHead(Message):
    """Key ``head``: a table exists; its rows' format; the version when it was written."""

    version: int
    rows: int = ROWS_FORMAT
    # Models in the table when the head was written (for an operator reading the bucket).
    models: int = 0


def rows_of(table: RoutingEndpoints) -> dict[str, ModelRouting]:
    """The rows of a whole table, each at the table's version."""
    models = set(table.endpoints) | set(table.unavailable) | set(table.coming) | set(table.cold)
    cold = set(table.cold)
    return {
        m: ModelRouting(
            version=table.version,
            model=m,
            endpoints=table.endpoints.get(m, ()),
            unavailable=table.unavailable.get(m),
            coming=table.coming.get(m),
            cold=m in cold,
        )
        for m in sorted(models)
    }


class RowFold:
    """The routing table as a reader holds it, fed key by key (:meth:`on_kv`, a ``KvFollower``
    callback's arguments): rows in, a ``RoutingEndpoints`` out. Keeps the table's maps up to date row by
    row, so a change costs the fold that row, and :meth:`table` is one object built from them. A legacy
    ``endpoints`` value stands for the whole table until a row or a head is seen."""

    def __init__(self) -> None:
        self.rows: dict[str, ModelRouting] = {}
        self.version = -1
        self.head: RoutingHead | None = None
        self.legacy: RoutingEndpoints | None = None
        # Models with an endpoint that takes new requests (not draining), and those scaled to zero.
        self.ready: set[str] = set()
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._unavailable: dict[str, str] = {}
        self._coming: dict[str, str] = {}
        self._cold: set[str] = set()
        # For a reader that applies changes in bursts (:meth:`take`): the models whose rows changed
        # since, or that the next apply must take the whole table (a start, the legacy value, the head).
        self._dirty: set[str] = set()
        self._whole = True

    def take(self) -> tuple[bool, set[str]]:
        """What changed since the last call: (whole table, models whose rows changed)."""
        out = (self._whole, self._dirty)
        self._whole, self._dirty = False, set()
        return out

    @property
    def read(self) -> bool:
        """Whether the rows are the table: a head was seen (written after the rows it announces), or
        there are rows and no legacy value. While a control plane turns a legacy table into rows, the
        legacy value stands until the head: rows half written are not a table with models missing."""
        return self.head is not None or (bool(self.rows) and self.legacy is None)

    @property
    def known(self) -> bool:
        """Whether any table was read: rows, or the legacy whole value."""
        return self.read or self.legacy is not None

    def on_kv(self, key: str, value: bytes | None) -> bool:
        """A key of ``<prefix>_routing`` changed: whether the table did. Raises ``DecodeError`` for a value
        that does not decode (the table is left as it was). A deleted ``endpoints`` or ``head`` is not an
        empty table: what is held stays."""
        if key == ROUTING_ENDPOINTS:
            if value is None:
                return False
            self.legacy = decode(value, RoutingEndpoints)
            if self.read:
                return False
            self._whole = True
            return True
        if key == ROUTING_HEAD:
            if value is None:
                return False
            was = self.read
            self.set_head(decode(value, RoutingHead))
            # The rows take over from a legacy table: the whole table changes at once.
            self._whole = self._whole or not was
            return True
        model = row_model(key)
        if model is None:
            return False
        if value is None:
            if model not in self.rows:
                return False
            self.drop(model)
            # A row's delete marker is a change too: the version moves (held requests wait on it).
            self.version += 1
            return self.read
        row = decode(value, ModelRouting)
        if row.model != model:
            # The key is what the writer deletes by: the row is that model's, whatever it says.
            row = row.model_copy(update={"model": model})
        self.put(row)
        return self.read

    def put(self, row: ModelRouting) -> None:
        self.drop(row.model)
        m = row.model
        self.rows[m] = row
        if row.endpoints:
            self._endpoints[m] = row.endpoints
            if any(not e.draining for e in row.endpoints):
                self.ready.add(m)
        if row.unavailable:
            self._unavailable[m] = row.unavailable
        if row.coming:
            self._coming[m] = row.coming
        if row.cold:
            self._cold.add(m)
        self.version = max(self.version, row.version)

    def drop(self, model: str) -> None:
        self._dirty.add(model)
        self.rows.pop(model, None)
        self._endpoints.pop(model, None)
        self._unavailable.pop(model, None)
        self._coming.pop(model, None)
        self._cold.discard(model)
        self.ready.discard(model)

    def set_head(self, head: RoutingHead) -> None:
        self.head = head
        self.version = max(self.version, head.version)

    def ready_models(self) -> set[str]:
        """The models with an endpoint taking new requests: the fold's own set (read it, do not change it;
        a copy per row would make a replay of thousands of rows quadratic)."""
        if not self.read and self.legacy is not None:
            return {m for m, eps in self.legacy.endpoints.items() if any(not e.draining for e in eps)}
        return self.ready

    def cold_models(self) -> set[str]:
        """The models scaled to zero: the fold's own set, as :meth:`ready_models`."""
        if not self.read and self.legacy is not None:
            return set(self.legacy.cold)
        return self._cold

    def table(self) -> RoutingEndpoints:
        """The whole table (the legacy value while no row was seen). Built without validation: every
        part was validated as its row was decoded."""
        if not self.read and self.legacy is not None:
            return self.legacy
        return RoutingEndpoints.model_construct(
            version=self.version,
            endpoints=dict(self._endpoints),
            unavailable=dict(self._unavailable),
            coming=dict(self._coming),
            cold=tuple(sorted(self._cold)),
        )
