"""``llmgw ctl``: ask the control plane (over NATS request/reply) and print tables or JSON.

Every command takes ``--nats``, ``--prefix``, ``--config`` and ``-o table|json``. When no control plane
answers, a clear message goes to stderr and the exit code is 1.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, ParamSpec, TypeVar

import typer

from llmgw_cli.ctl_failures import failed_note, models_failures, render_failed
from llmgw_cli.ctl_notes import nodes_legend
from llmgw_cli.ctl_scaling import scaling_lines
from llmgw_common.ctl import (
    CatalogApplyReply,
    CatalogDiff,
    ClassCapacity,
    CtlClient,
    CtlError,
    ExplainReply,
    MarksReply,
    ModelsReply,
    NodesReply,
    ReplicasReply,
    StatusReply,
)
from llmgw_common.durations import format_duration, parse_duration
from llmgw_common.messages import Message
from llmgw_common.names import visible

T = TypeVar("T", bound=Message)
P = ParamSpec("P")

NatsOpt = Annotated[list[str] | None, typer.Option("--nats", help="NATS URL (repeatable, or a comma list)")]
PrefixOpt = Annotated[str | None, typer.Option("--prefix", help="Subject and bucket prefix")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="YAML settings file")]
OutOpt = Annotated[str, typer.Option("-o", "--output", help="table or json")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the control plane")]

ctl_app = typer.Typer(
    name="ctl",
    help="Ask the control plane: nodes, replicas, models, status, catalog, marks.",
    no_args_is_help=True,
)
catalog_app = typer.Typer(name="catalog", help="Show, diff or apply the catalog.", no_args_is_help=True)
ctl_app.add_typer(catalog_app)


def _fail(message: str) -> typer.Exit:
    typer.echo("error: " + visible(message, keep="\n"), err=True)
    return typer.Exit(1)


def _call(
    nats_urls: list[str] | None,
    prefix: str | None,
    config: str | None,
    timeout: float,
    fn: Callable[[CtlClient], Awaitable[T]],
) -> T:
    """Connect, ask, close; every failure becomes a message on stderr and exit code 1."""
    import nats.errors
    from pydantic import ValidationError

    from llmgw_common import bus
    from llmgw_common.settings import BusSettings, load_settings

    urls = [u.strip() for v in nats_urls or [] for u in v.split(",") if u.strip()] or None
    try:
        s = load_settings(BusSettings, config, nats_urls=urls, prefix=prefix)
    except ValidationError as e:
        raise _fail(f"bad settings: {e}") from None

    async def run() -> T:
        try:
            nc = await bus.connect(s, "llmgw-ctl", connect_timeout=timeout, wait=False)
        except (nats.errors.Error, OSError, TimeoutError) as e:
            raise CtlError(
                f"cannot reach NATS at {', '.join(s.nats_urls)}: {e or type(e).__name__}"
            ) from None
        try:
            return await fn(CtlClient(nc, s.prefix, timeout=timeout))
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except CtlError as e:
        raise _fail(e.message) from None


def _check_output(output: str) -> None:
    if output not in ("table", "json"):
        raise _fail(f"unknown output {output!r}: use table or json")


def _json(msg: Message) -> None:
    typer.echo(json.dumps(msg.model_dump(mode="json"), indent=2, sort_keys=False))


def _shown(render: Callable[P, str]) -> Callable[P, str]:
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


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:g}{unit}"


# ---------------------------------------------------------------- renderers (pure, tested)


@_shown
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
                _num(n.memory_gb, " GB"),
                _num(n.cpus),
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


@_shown
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
    if problems:
        out += "\nerrors:\n" + "\n".join(problems)
    return out


@_shown
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
    return out


def usage_bar(c: ClassCapacity, width: int = 20) -> str:
    """``[###....xx-]``: used, free, unhealthy and held cards in proportion; a non-empty share shows."""
    if c.total <= 0:
        return "[" + " " * width + "]"
    parts = [(c.used, "#"), (c.unhealthy, "x"), (c.held, "-")]
    cells = {ch: (max(1, round(n * width / c.total)) if n else 0) for n, ch in parts}
    # Free takes what is left, so the bar is always ``width`` wide and a full class shows no free cell.
    taken = sum(cells.values())
    if taken > width:
        big = max(cells, key=lambda ch: cells[ch])
        cells[big] -= taken - width
        taken = width
    big = max(cells, key=lambda ch: cells[ch])
    if not c.free:
        cells[big] += width - taken  # rounding left a gap: the largest share takes it
        free = 0
    else:
        free = width - taken
        if free == 0:
            cells[big] -= 1
            free = 1
    return "[" + "#" * cells["#"] + "." * free + "x" * cells["x"] + "-" * cells["-"] + "]"


STATUS_LIST_MAX = 6
STATUS_WIDTH = 120


def _clip(line: str, width: int = STATUS_WIDTH) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _few(items: Sequence[str], where: str, most: int = 8) -> str:
    """``a, b, c and 12 more (see WHERE)``: the first ``most`` items and a count of the rest."""
    shown = ", ".join(items[:most])
    return shown if len(items) <= most else f"{shown} and {len(items) - most} more ({where})"


def _wrap_ids(ids: Sequence[str], max_lines: int = 3, width: int = STATUS_WIDTH) -> list[str]:
    """``ids`` in at most ``max_lines`` indented lines; the last says how many did not fit."""
    out: list[str] = []
    line = ""
    for i, rid in enumerate(ids):
        rest = len(ids) - i
        more = f" and {rest} more" if len(out) == max_lines - 1 else ""
        cand = f"{line}, {rid}" if line else f"  {rid}"
        # A line that is not the last ends with a comma: leave room for it.
        if len(cand) + max(len(more), 1) <= width or not line:
            line = cand
            continue
        if len(out) == max_lines - 1:
            return [*out, f"{line} and {rest} more"]
        out.append(line + ",")
        line = f"  {rid}"
    return [*out, line] if line else out


@_shown
def render_status(s: StatusReply) -> str:
    lines = [f"leader: {'yes' if s.leader else 'no'} (fence {s.fence}), catalog v{s.catalog_version}"]
    lines.append("capacity (unhealthy GPUs are neither used nor free; held: idle on cordoned, draining,")
    lines.append("  unreachable or lost nodes; bar: # used, . free, x unhealthy, - held):")
    caps = [
        [c.gpu_class, str(c.total), str(c.used), str(c.free), str(c.unhealthy), str(c.held), usage_bar(c)]
        for c in s.capacity
    ]
    lines.append(_indent(table(["GPU CLASS", "TOTAL", "USED", "FREE", "UNHEALTHY", "HELD", "USAGE"], caps)))

    def kv(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

    lines.append(f"free whole nodes per fabric: {kv(s.free_nodes_per_fabric)}")
    lines.append(f"nodes: {kv(s.nodes_by_state)}")
    lines.append(f"replicas: {kv(s.replicas_by_state)}")
    lines.append(f"models: {kv(s.models_by_state)}")
    # One screen at any fleet size: lists are cut to a few items, lines to a width, with where to see all.
    if s.unplaceable:
        lines.append(f"unplaceable: {len(s.unplaceable)} (why in full: `llmgw ctl explain-placement MODEL`)")
        lines.extend(_clip(f"  {u.model}: {u.reason}") for u in s.unplaceable[:STATUS_LIST_MAX])
        if len(s.unplaceable) > STATUS_LIST_MAX:
            lines.append(f"  and {len(s.unplaceable) - STATUS_LIST_MAX} more (`llmgw ctl models`)")
    idle = format_duration(s.idle_threshold_s)
    if s.idle_replicas:
        lines.append(f"idle for {idle} or more: {len(s.idle_replicas)} replica(s) (`llmgw ctl replicas`)")
        lines.extend(_wrap_ids(s.idle_replicas))
    else:
        lines.append(f"idle for {idle} or more: none known")
    if s.weights_per_fabric:
        lines.append("weights per fabric:")
        fabrics = list(s.weights_per_fabric.items())
        lines.extend(
            _clip(f"  {f}: {_few(w, '`llmgw ctl nodes -o json`')}") for f, w in fabrics[:STATUS_LIST_MAX]
        )
        if len(fabrics) > STATUS_LIST_MAX:
            lines.append(f"  and {len(fabrics) - STATUS_LIST_MAX} more fabrics")
    lines.extend(scaling_lines(s))
    lines.extend(f"warning: {w}" for w in s.warnings)
    return "\n".join(lines)


@_shown
def render_explain(e: ExplainReply) -> str:
    lines = [e.summary]
    lines.extend(f"  {p}" for p in e.placement)
    if e.nodes:
        rows = [[v.node, "fits" if v.ok else "refused", "; ".join(v.reasons)] for v in e.nodes]
        lines.append(table(["NODE", "VERDICT", "REASON"], rows))
    else:
        lines.append("no node has reported")
    if e.eviction:
        lines.append(f"eviction: {e.eviction}")
    return "\n".join(lines)


@_shown
def render_diff(d: CatalogDiff) -> str:
    if d.empty:
        return "no change"
    lines = [f"+ {n}" for n in d.added] + [f"- {n}" for n in d.removed]
    for m in d.changed:
        lines.append(f"~ {m.name}")
        lines.extend(f"    {c.field}: {c.old} -> {c.new}" for c in m.changes)
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


# ---------------------------------------------------------------- commands


@ctl_app.command("nodes")
def nodes(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Nodes: state, GPUs (used/free/total), memory ("-": not reported), marks."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.nodes())
    _json(r) if output == "json" else typer.echo(render_nodes(r))


@ctl_app.command("replicas")
def replicas(
    model: Annotated[str | None, typer.Option("--model", help="Only this model")] = None,
    failed: Annotated[
        bool, typer.Option("--failed", help="Recently failed replicas: shards, errors, log tails")
    ] = False,
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Replicas: state, nodes, endpoint, idle ("-": unknown); failed shards' errors and log tails."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.replicas(model))
    if output == "json":
        _json(r)
    elif failed:
        typer.echo(render_failed(r, time.time()))
    else:
        typer.echo(render_replicas(r) + failed_note(r, time.time()))


@ctl_app.command("models")
def models(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Catalog models: ready/desired replicas and, when not all ready, why."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.models())
    _json(r) if output == "json" else typer.echo(render_models(r) + models_failures(r, time.time()))


@ctl_app.command("status")
def status(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """The cluster at a glance: capacity, counts, unplaceable models, idle replicas, warnings."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.status())
    _json(r) if output == "json" else typer.echo(render_status(r))


@ctl_app.command("explain-placement")
def explain_placement(
    model: Annotated[str, typer.Argument(help="A catalog model")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Every node considered for MODEL and why it was refused, or where the next replica would go."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.explain_placement(model))
    _json(r) if output == "json" else typer.echo(render_explain(r))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise _fail(f"cannot read {path}: {e.strerror}") from None


@catalog_app.command("apply")
def catalog_apply(
    file: Annotated[Path, typer.Argument(help="Catalog YAML")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Validate FILE as a whole and, if valid, make it the catalog (no restart of anything)."""
    _check_output(output)
    text = _read(file)
    r: CatalogApplyReply = _call(nats_urls, prefix, config, timeout, lambda c: c.catalog_apply(text))
    if output == "json":
        _json(r)
    else:
        typer.echo(f"catalog v{r.version} applied\n{render_diff(r.diff)}")


@catalog_app.command("diff")
def catalog_diff(
    file: Annotated[Path, typer.Argument(help="Catalog YAML")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """What applying FILE would change: models added, removed, and changed fields."""
    _check_output(output)
    text = _read(file)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.catalog_diff(text))
    _json(r) if output == "json" else typer.echo(render_diff(r))


@catalog_app.command("show")
def catalog_show(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """The current catalog as YAML."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.catalog_show())
    if output == "json":
        _json(r)
    else:
        typer.echo(f"# catalog v{r.version}\n" + visible(r.yaml, keep="\n"), nl=False)


@_shown
def _marks_text(verb: str, r: MarksReply) -> str:
    d = r.marks.draining.get(r.node)
    if verb == "drain" and d is not None:
        return f"node {r.node} draining: replicas move off it, stopped by {format_duration(max(0.0, d - time.time()))} from now at the latest"
    return f"node {r.node} {verb}ed" if verb != "uncordon" else f"node {r.node} uncordoned (and not draining)"


@ctl_app.command("cordon")
def cordon(
    node: Annotated[str, typer.Argument(help="Node name")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """No new replicas on NODE; what runs there stays."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.cordon(node))
    _json(r) if output == "json" else typer.echo(_marks_text("cordon", r))


@ctl_app.command("uncordon")
def uncordon(
    node: Annotated[str, typer.Argument(help="Node name")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """NODE takes new replicas again (clears a drain too)."""
    _check_output(output)
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.uncordon(node))
    _json(r) if output == "json" else typer.echo(_marks_text("uncordon", r))


@ctl_app.command("drain")
def drain(
    node: Annotated[str, typer.Argument(help="Node name")],
    grace: Annotated[
        str | None, typer.Option("--grace", help="Stop what is left after this, e.g. 10m")
    ] = None,
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = "table",
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Move NODE's replicas elsewhere: each stops once its replacement serves, or when --grace runs out."""
    _check_output(output)
    try:
        grace_s = parse_duration(grace) if grace is not None else None
    except ValueError as e:
        raise _fail(str(e)) from None
    r = _call(nats_urls, prefix, config, timeout, lambda c: c.drain(node, grace_s))
    _json(r) if output == "json" else typer.echo(_marks_text("drain", r))


def register(app: typer.Typer) -> None:
    app.add_typer(ctl_app)
