"""``llmgw controlplane``: desired state, node and replica tables, the reconciler, the ctl API."""

from __future__ import annotations

import typer


def _urls(values: list[str]) -> list[str] | None:
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    return urls or None


def controlplane(
    config: str | None = typer.Option(None, help="YAML settings file (fields as LLMGW_* without the prefix)"),
    nats: list[str] = typer.Option([], "--nats", help="NATS URL (repeatable, or a comma list)"),
    prefix: str | None = typer.Option(None, help="Subject and bucket prefix"),
    catalog: str | None = typer.Option(
        None, "--catalog", help="Catalog YAML loaded at start when the bus holds none yet"
    ),
    admin_port: int | None = typer.Option(None, help="Port of the loopback admin listener; 0: none"),
) -> None:
    """Run a control plane (several may run: one leads, the others stand by)."""
    import asyncio

    from pydantic import ValidationError

    from llmgw_controlplane.service import StartupError, serve
    from llmgw_controlplane.settings import ControlPlaneSettings
    from llmgw_runtime.runtime import run_service, setup_logging
    from llmgw_runtime.settings import load_settings

    try:
        settings = load_settings(
            ControlPlaneSettings,
            config,
            nats_urls=_urls(nats),
            prefix=prefix,
            catalog_file=catalog,
            admin_port=admin_port,
        )
    except ValidationError as e:
        typer.echo(f"llmgw controlplane: bad settings: {e}", err=True)
        raise typer.Exit(2) from None
    setup_logging(settings.log_level, name="controlplane")

    async def main(stop: asyncio.Event) -> None:
        await serve(settings, stop)

    try:
        run_service(main)
    except StartupError as e:
        typer.echo(f"llmgw controlplane: not started: {e}", err=True)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.command("controlplane")(controlplane)
