"""What ``llmgw ctl`` prints: aligned tables and text from the control plane's replies, or their JSON.

Renderers are pure (reply -> text) and escape what came from elsewhere (:func:`shown`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import ParamSpec

from llmgw_cli.ctl_notes import nodes_legend
from llmgw_common.ctl import CatalogDiff, ExplainReply, MarksReply, ModelsReply, NodesReply, ReplicasReply
from llmgw_common.durations import format_duration
from llmgw_common.messages import Message
from llmgw_common.names import visible

P = ParamSpec("P")


def render_json(msg: Message) -> str:
    return json.dumps(msg.model_dump(mode="json"), indent=2, sort_keys=False)


def shown(render: Callable[P, str]) -> Callable[P, str]:
    """A renderer whose text reaches a terminal: names, reasons and engine log lines come from
    elsewhere, so their control characters (clear screen, OSC 8 links, bidi overrides) are written
    out (``\\x1b``), never sent. Line breaks between lines are the renderer's own and stay."""

    @functools.wraps(render)
    def shown(*args: P.args, **kwargs: P.kwargs) -> str:
        return visible(render(*args, **kwargs), keep="\n")

    return shown


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned text: one header line, one line per row, columns two spaces apart.
    Cells are escaped first (:func:`visible`), so columns align on what the terminal shows."""
    rows = [[visible(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    return "\n".join(lines)


def num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:g}{unit}"


@shown
def render_nodes(reply: NodesReply) -> str:
    rows = []
    for n in reply.nodes:
        flags = (("SIM", n.simulated), ("cordoned", n.cordoned), ("draining", n.draining))
        marks = ",".join(m for m, on in flags if on) or "-"
        gpus = (
            f"{n.gpus_used}/{n.gpus_free}/{n.gpus_held}/{n.gpus_total} {n.gpu_summary}".strip()
            if n.gpus_total
            else "-"
        )
        rows.append(
            [
                n.name,
                n.state,
                n.fabric or "-",
                gpus,
                str(n.gpus_unhealthy) if n.gpus_unhealthy else "-",
                num(n.memory_gb, " GB"),
                num(n.cpus),
                str(len(n.replicas)),
                marks,
                format_duration(n.last_seen_s) if n.last_seen_s is not None else "-",
            ]
        )
    out = table(
        [
            "NODE",
            "STATE",
            "FABRIC",
            "GPUS used/free/held/total",
            "UNHEALTHY",
            "MEM",
            "CPUS",
            "REPLICAS",
            "MARKS",
            "SEEN",
        ],
        rows,
    )
    notes = [f"  {n.name}: {r}" for n in reply.nodes for r in n.unhealthy_reasons]
    if notes:
        out += "\nunhealthy GPUs (neither used nor free):\n" + "\n".join(notes)
    return out + nodes_legend(reply)


@shown
def render_replicas(reply: ReplicasReply) -> str:
    rows = []
    for r in reply.replicas:
        nodes = ",".join(dict.fromkeys(s.node for s in r.shards)) or "-"
        state = r.state + (" (draining)" if r.draining else " (old profile)" if r.outdated else "")
        breaker = "" if r.breaker == "closed" else r.breaker.replace("_", "-")
        rows.append([r.id, r.model, state, nodes, r.endpoint or "-", breaker or "closed", r.idle])
    out = table(["REPLICA", "MODEL", "STATE", "NODES", "ENDPOINT", "BREAKER", "IDLE"], rows)
    problems = []
    for r in reply.replicas:
        for s in r.shards:
            if s.error or s.log_tail:
                problems.append(f"{r.id} shard {s.shard} on {s.node}: {s.error or s.state}")
                problems.extend(f"    | {line}" for line in s.log_tail)
    for r in reply.replicas:
        problems.extend(f"{r.id} adapter {a}: {e}" for a, e in sorted(r.adapter_errors.items()))
    if problems:
        out += "\nerrors:\n" + "\n".join(problems)
    return out


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


@shown
def render_models(reply: ModelsReply) -> str:
    rows = []
    for m in reply.models:
        gpu = f"{m.gpus_per_node}x{m.gpu_class}" if m.gpu_class else "cpu"
        if m.nodes > 1:
            gpu = f"{m.nodes} nodes x {gpu}"
        rows.append(
            [
                m.name + (" *" if m.watched else ""),
                m.engine,
                gpu,
                f"{m.ready}/{m.desired}",
                m.state,
                m.reason or "-",
            ]
        )
    out = table(["MODEL", "ENGINE", "GPUS", "READY", "STATE", "REASON"], rows)
    if any(m.watched for m in reply.models):
        out += "\n* watched: alerts when it has had no ready replica for its watch budget"
    cached = [m for m in reply.models if m.cache is not None]
    if cached:
        crow = []
        for m in cached:
            c = m.cache
            assert c is not None
            crow.append(
                [
                    m.name,
                    c.mode,
                    str(c.routers),
                    _share(c.predicted_hit_rate),
                    _share(c.engine_hit_rate),
                    str(c.index_blocks),
                    "-" if c.event_lag_ms is None else f"{c.event_lag_ms:.0f} ms",
                ]
            )
        # Predicted: what the routers expected cached where they sent requests; engines: what the
        # engines' own counters say they found. Far apart means the index or the tokenizer is off.
        out += "\n\n" + table(
            ["MODEL", "CACHE ROUTING", "ROUTERS", "PREDICTED HIT", "ENGINE HIT", "INDEX BLOCKS", "EVENT LAG"],
            crow,
        )
    for m in reply.models:
        f = m.scaling
        if f is not None:
            # Issue 21: the count a load-following model asks for, and why (or what holds it).
            out += f"\n{m.name} follows load (target {f.target}): wants {f.wants}; {f.why}"
    if reply.adapters:
        out += "\n\n" + render_adapters(reply)
    return out


def render_adapters(reply: ModelsReply) -> str:
    """LoRA adapters (issue 33): their base, where loaded (or asked), loads and unloads, and why not."""
    rows = []
    for a in reply.adapters:
        where = ",".join(a.loaded_on) or (f"asked of {','.join(a.assigned_to)}" if a.assigned_to else "-")
        rows.append(
            [a.name, a.base, a.state, where, str(a.requests), f"{a.loads}/{a.unloads}", a.reason or "-"]
        )
    return table(["ADAPTER", "BASE", "STATE", "LOADED ON", "REQUESTS", "LOADS/UNLOADS", "REASON"], rows)


@shown
def render_explain(e: ExplainReply) -> str:
    lines = [e.summary]
    if e.scaling:
        lines.append(e.scaling)
    lines.extend(f"  {p}" for p in e.placement)
    if e.nodes:
        rows = [[v.node, "fits" if v.ok else "refused", "; ".join(v.reasons)] for v in e.nodes]
        lines.append(table(["NODE", "VERDICT", "REASON"], rows))
    else:
        lines.append("no node has reported")
    if e.eviction:
        lines.append(f"eviction: {e.eviction}")
    return "\n".join(lines)


@shown
def render_diff(d: CatalogDiff) -> str:
    if d.empty:
        return "no change"
    lines = [f"+ {n}" for n in d.added] + [f"- {n}" for n in d.removed]
    for m in d.changed:
        lines.append(f"~ {m.name}")
        lines.extend(f"    {c.field}: {c.old} -> {c.new}" for c in m.changes)
    return "\n".join(lines)


@shown
def marks_text(verb: str, r: MarksReply) -> str:
    d = r.marks.draining.get(r.node)
    if verb == "drain" and d is not None:
        return f"node {r.node} draining: replicas move off it, stopped by {format_duration(max(0.0, d - time.time()))} from now at the latest"
    return f"node {r.node} {verb}ed" if verb != "uncordon" else f"node {r.node} uncordoned (and not draining)"
