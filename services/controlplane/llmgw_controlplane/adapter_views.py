"""ctl replies about LoRA adapters (issue 33), built from a snapshot and the adapter book (pure).

- :func:`adapters_info`: `ctl models`' adapters: base, state, where loaded and asked, load and unload counts.
- :func:`adapter_explain`: `ctl explain-placement ADAPTER`: whether it can be served and, per replica of
  its base, why it is or is not loaded there.
- :func:`with_adapters`: `ctl replicas` rows with what each replica's node reports of its adapters.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw_common.catalog import AdapterProfile
from llmgw_common.ctl import AdapterInfo, ExplainReply, NodeVerdict, ReplicaInfo
from llmgw_controlplane.scheduler.adapter_book import AdapterBook, adapter_errors, loaded_on
from llmgw_controlplane.scheduler.adapters import slots_of
from llmgw_controlplane.scheduler.phase import replica_phase, serving
from llmgw_controlplane.scheduler.snapshot import Snapshot


def adapters_info(snap: Snapshot, book: AdapterBook, requests: Mapping[str, int]) -> tuple[AdapterInfo, ...]:
    seen = book.seen(snap)
    last = book.last
    memo = book.memo
    out = []
    for a in snap.catalog.adapters:
        loaded = tuple(loaded_on(snap, seen, a.name))
        assigned = tuple(sorted(r for r, names in (last.assigned if last else {}).items() if a.name in names))
        errors = adapter_errors(snap, seen, a)
        waiting = last.waiting.get(a.name) if last is not None else None
        mine = [r for r in snap.replicas if r.model == a.base and not r.draining]
        if loaded:
            state, reason = "loaded", None
        elif mine and errors and all(r.id in errors for r in mine):
            state, reason = "failed", "; ".join(f"replica {r}: {e}" for r, e in sorted(errors.items()))
        elif waiting:
            state, reason = "waiting", waiting
        elif assigned:
            state, reason = "loading", None
        else:
            state, reason = "idle", None
        out.append(
            AdapterInfo(
                name=a.name,
                base=a.base,
                weights=a.weights,
                rank=a.rank,
                state=state,
                reason=reason,
                loaded_on=loaded,
                assigned_to=assigned,
                loads=memo.loads.get(a.name, 0) if memo else 0,
                unloads=memo.unloads.get(a.name, 0) if memo else 0,
                requests=requests.get(a.name, 0),
                errors=errors,
            )
        )
    return tuple(out)


def adapter_explain(snap: Snapshot, book: AdapterBook, a: AdapterProfile) -> ExplainReply:
    """Why ``a`` is or is not served: its base, then each replica of the base."""
    seen = book.seen(snap)
    base = snap.catalog.get(a.base)
    assigned = book.last.assigned if book.last is not None else {}
    verdicts = []
    for r in snap.replicas:
        if r.model != a.base:
            continue
        s = seen.get(r.id)
        where = f"replica {r.id} ({', '.join(r.nodes) or '-'})"
        names = assigned.get(r.id, ())
        slots = slots_of(r, base) if base is not None else 0
        if s is not None and a.name in s.loaded and serving(snap, r):
            verdicts.append(NodeVerdict(node=where, ok=True, reasons=("loaded",)))
        elif s is not None and a.name in s.errors:
            verdicts.append(
                NodeVerdict(node=where, ok=False, reasons=(f"its load failed: {s.errors[a.name]}",))
            )
        elif r.draining:
            verdicts.append(NodeVerdict(node=where, ok=False, reasons=("draining: takes no new adapter",)))
        elif slots == 0:
            verdicts.append(NodeVerdict(node=where, ok=False, reasons=("started without LoRA (max_loras)",)))
        elif a.name in names:
            verdicts.append(
                NodeVerdict(node=where, ok=True, reasons=(f"asked to load it ({replica_phase(snap, r)})",))
            )
        else:
            busy = sorted(s.busy) if s is not None else []
            held = f"holds {len(names)} of {slots} adapters"
            verdicts.append(
                NodeVerdict(
                    node=where,
                    ok=len(names) < slots,
                    reasons=(held + (f"; busy: {', '.join(busy)}" if busy else ""),),
                )
            )
    waiting = book.last.waiting.get(a.name) if book.last is not None else None
    if base is None:
        summary, ok = f"adapter {a.name}: its base {a.base} is not in the catalog", False
    elif any(v.ok and v.reasons == ("loaded",) for v in verdicts):
        summary, ok = f"adapter {a.name} of {a.base} is loaded and served", True
    elif not verdicts:
        summary, ok = f"adapter {a.name} of {a.base}: no replica of {a.base} runs; a request wakes it", False
    elif waiting:
        summary, ok = f"adapter {a.name} of {a.base} cannot be loaded now: {waiting}", False
    elif all(not v.ok for v in verdicts):
        summary, ok = f"adapter {a.name} of {a.base} cannot be loaded on any replica of its base", False
    else:
        summary, ok = f"adapter {a.name} of {a.base} is loaded when a request asks for it", True
    return ExplainReply(model=a.name, placeable=ok, summary=summary, nodes=tuple(verdicts))


def with_adapters(
    rows: tuple[ReplicaInfo, ...], snap: Snapshot, book: AdapterBook
) -> tuple[ReplicaInfo, ...]:
    seen = book.seen(snap)
    out = []
    for r in rows:
        s = seen.get(r.id)
        if s is None or not (s.loaded or s.errors):
            out.append(r)
            continue
        out.append(
            r.model_copy(update={"adapters": tuple(sorted(s.loaded)), "adapter_errors": dict(s.errors)})
        )
    return tuple(out)
