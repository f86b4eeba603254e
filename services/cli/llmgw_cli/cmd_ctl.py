"""``llmgw ctl``: ask the control plane (over NATS request/reply) and print tables or JSON.

Every command takes ``--nats``, ``--prefix``, ``--config`` and ``-o table|json`` (ctl_options.py). When
no control plane answers, a clear message goes to stderr and the exit code is 1 (ctl_call.py). What is
printed is in ctl_render.py and ctl_status.py; the catalog subgroup in ctl_catalog.py.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from llmgw_cli.ctl_call import call
from llmgw_cli.ctl_catalog import catalog_app
from llmgw_cli.ctl_failures import failed_note, models_failures, render_failed
from llmgw_cli.ctl_options import ConfigOpt, NatsOpt, OutOpt, Output, PrefixOpt, TimeoutOpt, fail
from llmgw_cli.ctl_render import (
    marks_text,
    render_explain,
    render_json,
    render_models,
    render_nodes,
    render_replicas,
)
from llmgw_cli.ctl_status import render_status
from llmgw_common.durations import parse_duration

ctl_app = typer.Typer(
    name="ctl",
    help="Ask the control plane: nodes, replicas, models, status, catalog, marks.",
    no_args_is_help=True,
)
ctl_app.add_typer(catalog_app)


@ctl_app.command("nodes")
def nodes(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Nodes: state, GPUs (used/free/total), memory ("-": not reported), marks."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.nodes())
    typer.echo(render_json(r) if output is Output.JSON else render_nodes(r))


@ctl_app.command("replicas")
def replicas(
    model: Annotated[str | None, typer.Option("--model", help="Only this model")] = None,
    failed: Annotated[
        bool, typer.Option("--failed", help="Recently failed replicas: shards, errors, log tails")
    ] = False,
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Replicas: state, nodes, endpoint, idle ("-": unknown); failed shards' errors and log tails."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.replicas(model))
    if output is Output.JSON:
        typer.echo(render_json(r))
    elif failed:
        typer.echo(render_failed(r, time.time()))
    else:
        typer.echo(render_replicas(r) + failed_note(r, time.time()))


@ctl_app.command("models")
def models(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Catalog models: ready/desired replicas and, when not all ready, why."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.models())
    typer.echo(
        render_json(r) if output is Output.JSON else render_models(r) + models_failures(r, time.time())
    )


@ctl_app.command("status")
def status(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """The cluster at a glance: capacity, counts, unplaceable models, idle replicas, warnings."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.status())
    typer.echo(render_json(r) if output is Output.JSON else render_status(r))


@ctl_app.command("explain-placement")
def explain_placement(
    model: Annotated[str, typer.Argument(help="A catalog model")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Every node considered for MODEL and why it was refused, or where the next replica would go."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.explain_placement(model))
    typer.echo(render_json(r) if output is Output.JSON else render_explain(r))


@ctl_app.command("cordon")
def cordon(
    node: Annotated[str, typer.Argument(help="Node name")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """No new replicas on NODE; what runs there stays."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.cordon(node))
    typer.echo(render_json(r) if output is Output.JSON else marks_text("cordon", r))


@ctl_app.command("uncordon")
def uncordon(
    node: Annotated[str, typer.Argument(help="Node name")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """NODE takes new replicas again (clears a drain too)."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.uncordon(node))
    typer.echo(render_json(r) if output is Output.JSON else marks_text("uncordon", r))


@ctl_app.command("drain")
def drain(
    node: Annotated[str, typer.Argument(help="Node name")],
    grace: Annotated[
        str | None, typer.Option("--grace", help="Stop what is left after this, e.g. 10m")
    ] = None,
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """Move NODE's replicas elsewhere: each stops once its replacement serves, or when --grace runs out."""
    try:
        grace_s = parse_duration(grace) if grace is not None else None
    except ValueError as e:
        raise fail(str(e)) from None
    r = call(nats_urls, prefix, config, timeout, lambda c: c.drain(node, grace_s))
    typer.echo(render_json(r) if output is Output.JSON else marks_text("drain", r))


def register(app: typer.Typer) -> None:
    app.add_typer(ctl_app)
