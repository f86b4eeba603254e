"""``llmgw router``: the OpenAI-compatible gateway."""

from __future__ import annotations

import typer


def _urls(values: list[str]) -> list[str] | None:
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    return urls or None


def router(
    config: str | None = typer.Option(None, help="YAML settings file (fields as LLMGW_* without the prefix)"),
    nats: list[str] = typer.Option([], "--nats", help="NATS URL (repeatable, or a comma list)"),
    prefix: str | None = typer.Option(None, help="Subject and bucket prefix"),
    host: str | None = typer.Option(None, help="Address of the OpenAI listener"),
    port: int | None = typer.Option(None, help="Port of the OpenAI listener (0: any free port)"),
    admin_port: int | None = typer.Option(
        None, help="Port of the loopback admin listener (/metrics); 0: none"
    ),
    static: str | None = typer.Option(
        None, "--static", help="Serve the models and endpoints of this YAML file, without NATS"
    ),
    no_auth: bool = typer.Option(False, "--no-auth", help="Serve without API keys (trusted networks only)"),
    router_id: str | None = typer.Option(None, help="This router's id in idle and usage reports"),
    workers: int = typer.Option(
        1,
        min=1,
        help="Router processes sharing the port (SO_REUSEPORT); worker i is <router-id>-w<i>, "
        "its admin listener on admin-port + i",
    ),
) -> None:
    """Run a router: the OpenAI-compatible API in front of the cluster's engines."""
    from pydantic import ValidationError

    from llmgw_router.service import serve
    from llmgw_router.settings import RouterSettings
    from llmgw_router.static import StaticConfigError, load_static
    from llmgw_runtime.runtime import run_service, setup_logging
    from llmgw_runtime.settings import load_settings

    urls = _urls(nats)
    overrides = dict(
        nats_urls=urls,
        prefix=prefix,
        host=host,
        port=port,
        admin_port=admin_port,
        static_file=static,
        auth=False if no_auth else None,
        router_id=router_id,
    )
    try:
        settings = load_settings(RouterSettings, config, **overrides)
    except ValidationError as e:
        typer.echo(f"llmgw router: bad settings: {e}", err=True)
        raise typer.Exit(2) from None
    if settings.static_file:
        try:
            load_static(settings.static_file)
        except StaticConfigError as e:
            typer.echo(f"llmgw router: {e}", err=True)
            raise typer.Exit(2) from None
    # Static mode stays off the bus unless --nats is given too: then a pushed catalog replaces the seed.
    follow_bus = None if not settings.static_file else bool(urls)
    if workers > 1:
        if settings.port == 0:
            typer.echo("llmgw router: --workers needs a fixed --port (0 would give each its own)", err=True)
            raise typer.Exit(2)
        from llmgw_router.workers import run_workers

        raise typer.Exit(run_workers(settings, workers, follow_bus))
    setup_logging(settings.log_level, name=f"router[{settings.router_id}]")
    run_service(lambda stop: serve(settings, stop, follow_bus=follow_bus))


def register(app: typer.Typer) -> None:
    app.command("router")(router)
