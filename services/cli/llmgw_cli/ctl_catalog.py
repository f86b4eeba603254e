"""``llmgw ctl catalog show|diff|apply``: the catalog the control plane serves from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw_cli.ctl_call import call, read_text
from llmgw_cli.ctl_options import ConfigOpt, NatsOpt, OutOpt, Output, PrefixOpt, TimeoutOpt
from llmgw_cli.ctl_render import render_diff, render_json
from llmgw_common.ctl import CatalogApplyReply
from llmgw_common.names import visible

catalog_app = typer.Typer(name="catalog", help="Show, diff or apply the catalog.", no_args_is_help=True)


@catalog_app.command("apply")
def catalog_apply(
    file: Annotated[Path, typer.Argument(help="Catalog YAML")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 5.0,
) -> None:
    """Validate FILE as a whole and, if valid, make it the catalog (no restart of anything)."""
    text = read_text(file)
    r: CatalogApplyReply = call(nats_urls, prefix, config, timeout, lambda c: c.catalog_apply(text))
    if output is Output.JSON:
        typer.echo(render_json(r))
    else:
        typer.echo(f"catalog v{r.version} applied\n{render_diff(r.diff)}")


@catalog_app.command("diff")
def catalog_diff(
    file: Annotated[Path, typer.Argument(help="Catalog YAML")],
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """What applying FILE would change: models added, removed, and changed fields."""
    text = read_text(file)
    r = call(nats_urls, prefix, config, timeout, lambda c: c.catalog_diff(text))
    typer.echo(render_json(r) if output is Output.JSON else render_diff(r))


@catalog_app.command("show")
def catalog_show(
    nats_urls: NatsOpt = None,
    prefix: PrefixOpt = None,
    config: ConfigOpt = None,
    output: OutOpt = Output.TABLE,
    timeout: TimeoutOpt = 2.0,
) -> None:
    """The current catalog as YAML."""
    r = call(nats_urls, prefix, config, timeout, lambda c: c.catalog_show())
    if output is Output.JSON:
        typer.echo(render_json(r))
    else:
        typer.echo(f"# catalog v{r.version}\n" + visible(r.yaml, keep="\n"), nl=False)
