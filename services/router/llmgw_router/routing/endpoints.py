"""The endpoint pool: what each model can be routed to, with live state that outlives updates.

Routing updates (``RoutingEndpoints`` from the control plane, or a static file) replace the set of
endpoints per model; each endpoint's live state (in-flight count, breaker, latency, last load report)
is keyed by replica id + URL and carried across updates, so an unrelated change resets nothing. An
endpoint that leaves the set is dropped from the routing lists and returned by :meth:`Pool.set_endpoints`:
the control plane withdraws an endpoint whose node was lost or whose replica failed or was stopped, so
the caller aborts the answers still in flight to it (they continue elsewhere, mid-stream failover). A
``draining`` endpoint stays in the set: it takes no new requests and finishes what it holds.

LoRA adapters (issue 33) have no endpoints of their own: an adapter is served by the endpoints of its
base whose latest load report lists it loaded (``EndpointState.adapters``), and is in :attr:`Pool.ready`
while one of them takes new requests. An engine that answers 404 to an adapter it was said to hold
(unloaded since, or restarted) loses it here until its next report lists it again (:meth:`Pool.forget_adapter`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw_common.catalog import AdapterProfile, Catalog, ModelProfile
from llmgw_common.messages import Endpoint, LoadReport, RoutingEndpoints
from llmgw_common.routing_table import ModelRouting
from llmgw_router.routing.breaker import Breaker, BreakerState
from llmgw_router.routing.scheduling import stable_id
from llmgw_router.upstream.connection import Answers

# Weight of the newest sample in the latency average.
EWMA_ALPHA = 0.2


def tag_of(affinity_id: int) -> str:
    """A replica's tag, written into the ids of the responses it stores (dialects/stored.py): 16 hex
    digits of its stable hash, the same in every router."""
    return f"{affinity_id:016x}"


class EndpointState:
    """One endpoint and what this router knows about it right now."""

    __slots__ = (
        "adapter_errors",
        "adapters",
        "affinity_id",
        "answers",
        "breaker",
        "draining",
        "ewma_latency_s",
        "in_flight",
        "kv_use",
        "load_at",
        "model",
        "node",
        "prefix_hits",
        "prefix_queries",
        "replica_id",
        "running",
        "tag",
        "url",
        "waiting",
    )

    def __init__(self, ep: Endpoint, breaker: Breaker) -> None:
        self.replica_id = ep.replica_id
        # The replica's place in prefix-affinity orders: the same in every router.
        self.affinity_id = stable_id(ep.replica_id)
        # The replica's mark in the ids of the responses it stores (stored.py), the same in every router.
        self.tag = tag_of(self.affinity_id)
        self.model = ep.model
        self.url = ep.url.rstrip("/")
        self.node = ep.node
        self.draining = ep.draining
        self.in_flight = 0
        # The attempts in flight to this endpoint, one handle each (the connection while the answer's head
        # is awaited, then the answer; removed in the attempt's ``finally``): aborted if it is withdrawn.
        self.answers = Answers()
        self.breaker = breaker
        self.ewma_latency_s: float | None = None
        self.running: float | None = None
        self.waiting: float | None = None
        self.kv_use: float | None = None
        # Our clock's time when the load report arrived (freshness by our own clock).
        self.load_at: float | None = None
        # The engine's own prefix-cache counters (tokens since it started), for operators.
        self.prefix_queries: float | None = None
        self.prefix_hits: float | None = None
        # LoRA adapters, from the latest load report: loaded and serving; why a load failed, by adapter.
        self.adapters: frozenset[str] = frozenset()
        self.adapter_errors: dict[str, str] = {}

    @property
    def key(self) -> tuple[str, str]:
        return (self.replica_id, self.url)

    def observe_latency(self, seconds: float) -> None:
        prev = self.ewma_latency_s
        self.ewma_latency_s = seconds if prev is None else prev + EWMA_ALPHA * (seconds - prev)

    def __repr__(self) -> str:
        return f"EndpointState({self.replica_id} {self.url} in_flight={self.in_flight})"


def endpoint_key(ep: Endpoint) -> tuple[str, str]:
    return (ep.replica_id, ep.url.rstrip("/"))


class Pool:
    """Models -> endpoint states, plus the catalog and why models without endpoints are unavailable."""

    def __init__(self, breaker_threshold: int = 3, breaker_cooldown_s: float = 2.0) -> None:
        self.catalog: Catalog | None = None
        self.catalog_version = -1
        self.endpoints_version = -1
        self.profiles: dict[str, ModelProfile] = {}
        # The catalog's LoRA adapters by name: requested as models, served by their base's endpoints.
        self.adapters: dict[str, AdapterProfile] = {}
        self.by_model: dict[str, list[EndpointState]] = {}
        self.by_key: dict[tuple[str, str], EndpointState] = {}
        self.by_replica: dict[str, list[EndpointState]] = {}
        # tag_of(replica) -> its endpoint: where a tagged response id is answered.
        self.by_tag: dict[str, EndpointState] = {}
        self.unavailable: dict[str, str] = {}
        # Models with an endpoint that takes new requests (not draining), and adapters loaded on one: the
        # request path's one check.
        self.ready: set[str] = set()
        self._ready_models: set[str] = set()
        # From the control plane: what is on its way per model, and the models scaled to zero.
        self.coming: dict[str, str] = {}
        self.cold: frozenset[str] = frozenset()
        # False until the first routing endpoints arrive (a static file's included): until then a
        # catalog model's requests are held, not refused (a cluster starting: no control plane led yet).
        self.table_read = False
        self._breaker_threshold = breaker_threshold
        self._breaker_cooldown_s = breaker_cooldown_s

    # ------------------------------------------------------------ updates

    def set_catalog(self, catalog: Catalog, version: int = 0) -> None:
        self.catalog = catalog
        self.catalog_version = version
        self.profiles = {m.name: m for m in catalog.models}
        self.adapters = {a.name: a for a in catalog.adapters}
        self._ready_adapters()

    def set_endpoints(self, routing: RoutingEndpoints) -> list[EndpointState]:
        """Replace the endpoints; return those withdrawn (in the old set, not the new)."""
        old = self.by_key
        self._apply(routing.endpoints.values(), routing.unavailable)
        self.coming = dict(routing.coming)
        self.cold = frozenset(routing.cold)
        self.endpoints_version = routing.version
        self.table_read = True
        return [st for k, st in old.items() if k not in self.by_key]

    def set_models(self, rows: Mapping[str, ModelRouting | None], version: int) -> list[EndpointState]:
        """Replace the endpoints and state of the models in ``rows`` only (None: the model left the table),
        at a cost of those models' endpoints, not the table's (issue 35: 20,000 endpoints rebuilt whole
        took a router ~0.3 s per change); return the endpoints withdrawn."""
        withdrawn: list[EndpointState] = []
        cold = set(self.cold)
        for model, row in rows.items():
            eps = row.endpoints if row is not None else ()
            old = self.by_model.pop(model, [])
            new: list[EndpointState] = []
            keys = set()
            for ep in eps:
                k = endpoint_key(ep)
                keys.add(k)
                st = self.by_key.get(k)
                if st is None:
                    st = EndpointState(ep, Breaker(self._breaker_threshold, self._breaker_cooldown_s))
                    self.by_key[k] = st
                    self.by_replica.setdefault(ep.replica_id, []).append(st)
                    self.by_tag[st.tag] = st
                else:
                    st.draining = ep.draining
                    st.node = ep.node
                new.append(st)
            for st in old:
                if st.key in keys:
                    continue
                withdrawn.append(st)
                self.by_key.pop(st.key, None)
                if self.by_tag.get(st.tag) is st:
                    del self.by_tag[st.tag]
                same = [e for e in self.by_replica.get(st.replica_id, ()) if e is not st]
                if same:
                    self.by_replica[st.replica_id] = same
                else:
                    self.by_replica.pop(st.replica_id, None)
            if new:
                self.by_model[model] = new
            if any(not e.draining for e in new):
                self._ready_models.add(model)
            else:
                self._ready_models.discard(model)
            for table, value in (
                (self.unavailable, row and row.unavailable),
                (self.coming, row and row.coming),
            ):
                if value:
                    table[model] = value
                else:
                    table.pop(model, None)
            if row is not None and row.cold:
                cold.add(model)
            else:
                cold.discard(model)
        self.cold = frozenset(cold)
        self._ready_adapters()
        self.endpoints_version = version
        self.table_read = True
        return withdrawn

    def _apply(self, groups: Iterable[Iterable[Endpoint]], unavailable: dict[str, str]) -> None:
        by_key: dict[tuple[str, str], EndpointState] = {}
        by_model: dict[str, list[EndpointState]] = {}
        by_replica: dict[str, list[EndpointState]] = {}
        for group in groups:
            for ep in group:
                k = endpoint_key(ep)
                st = self.by_key.get(k)
                if st is None:
                    st = EndpointState(ep, Breaker(self._breaker_threshold, self._breaker_cooldown_s))
                else:
                    st.draining = ep.draining
                    st.node = ep.node
                by_key[k] = st
                by_model.setdefault(ep.model, []).append(st)
                by_replica.setdefault(ep.replica_id, []).append(st)
        self.by_key, self.by_model, self.by_replica = by_key, by_model, by_replica
        self.by_tag = {st.tag: st for st in by_key.values()}
        self._ready_models = {m for m, eps in by_model.items() if any(not e.draining for e in eps)}
        self.unavailable = dict(unavailable)
        self._ready_adapters()

    def apply_load(self, report: LoadReport, now: float) -> bool:
        """Record an agent's load report; shards other than 0 (followers) carry no routing load. Whether
        an endpoint's adapters or adapter errors changed (held requests for an adapter may go on)."""
        changed = False
        for r in report.replicas:
            if r.shard != 0:
                continue
            for st in self.by_replica.get(r.replica_id, ()):
                st.running, st.waiting, st.kv_use, st.load_at = r.running, r.waiting, r.kv_use, now
                st.prefix_queries, st.prefix_hits = r.prefix_queries, r.prefix_hits
                if ((r.adapters or st.adapters) and st.adapters != frozenset(r.adapters)) or (
                    st.adapter_errors != r.adapter_errors
                ):
                    st.adapters, st.adapter_errors = frozenset(r.adapters), dict(r.adapter_errors)
                    changed = True
        if changed:
            self._ready_adapters()
        return changed

    def forget_adapter(self, st: EndpointState, adapter: str) -> None:
        """``st``'s engine does not have ``adapter`` (it answered 404 for it): not a holder until its next
        load report lists it again."""
        if adapter in st.adapters:
            st.adapters = st.adapters - {adapter}
            self._ready_adapters()

    def _ready_adapters(self) -> None:
        ready = set(self._ready_models)
        for name, a in self.adapters.items():
            if any(name in e.adapters and not e.draining for e in self.by_model.get(a.base, ())):
                ready.add(name)
        self.ready = ready

    # ------------------------------------------------------------ reads

    def prefix_counters(self, model: str) -> tuple[float, float]:
        """The engines' own prefix-cache counters (queries, hits in tokens), summed over the model's
        endpoints that report them."""
        q = h = 0.0
        for st in self.by_model.get(model, ()):
            if st.prefix_queries is not None and st.prefix_hits is not None:
                q += st.prefix_queries
                h += st.prefix_hits
        return q, h

    def known(self, model: str) -> bool:
        return model in self.profiles

    def holders(self, adapter: str) -> list[EndpointState]:
        """The endpoints of an adapter's base whose latest report lists it loaded."""
        a = self.adapters.get(adapter)
        if a is None:
            return []
        return [e for e in self.by_model.get(a.base, ()) if adapter in e.adapters]

    def adapter_error(self, adapter: str) -> str | None:
        """Why the adapter could not be loaded, as a replica of its base last reported it; None when none
        did, or while one holds it (a replica that loaded it serves it: another's failure is not its)."""
        a = self.adapters.get(adapter)
        if a is None:
            return None
        errors = []
        for e in self.by_model.get(a.base, ()):
            if adapter in e.adapters:
                return None
            why = e.adapter_errors.get(adapter)
            if why:
                errors.append(why)
        return min(errors) if errors else None

    def routable(self, model: str, now: float) -> list[EndpointState]:
        """Endpoints that may take a new request now: not draining, breaker permitting."""
        eps = self.by_model.get(model)
        if not eps:
            return []
        return [e for e in eps if not e.draining and e.breaker.allows(now)]

    def why_unavailable(self, model: str, now: float) -> str:
        a = self.adapters.get(model)
        if a is not None:
            return self._why_adapter(a, now)
        eps = self.by_model.get(model)
        if eps:
            if all(e.draining for e in eps):
                return f"every replica of model {model!r} is draining"
            return f"every replica of model {model!r} is failing (circuit open); retrying shortly"
        reason = self.unavailable.get(model)
        if reason:
            return f"model {model!r} has no ready replica: {reason}"
        return f"model {model!r} has no ready replica"

    def _why_adapter(self, a: AdapterProfile, now: float) -> str:
        error = self.adapter_error(a.name)
        if error is not None:
            return f"adapter {a.name!r} (of model {a.base!r}) could not be loaded: {error}"
        held = self.holders(a.name)
        if held:
            if all(e.draining for e in held):
                return f"every replica of model {a.base!r} holding adapter {a.name!r} is draining"
            return f"every replica of model {a.base!r} holding adapter {a.name!r} is failing (circuit open); retrying shortly"
        if self.by_model.get(a.base):
            return f"adapter {a.name!r} is not loaded on any ready replica of model {a.base!r}"
        return f"adapter {a.name!r}: " + self.why_unavailable(a.base, now)

    def breakers_not_closed(self) -> dict[str, str]:
        """replica id -> breaker state, for replicas whose breaker is open or half-open."""
        out: dict[str, str] = {}
        for st in self.by_key.values():
            if st.breaker.state is not BreakerState.CLOSED:
                out[st.replica_id] = st.breaker.state.value
        return out

    def busy(self) -> set[str]:
        """Replicas with a request of this router in flight (a stream being relayed included)."""
        return {e.replica_id for e in self.by_key.values() if e.in_flight > 0}

    def in_flight_total(self) -> int:
        return sum(e.in_flight for e in self.by_key.values())
