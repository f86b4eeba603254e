"""``llmgw notifier``: webhooks for cluster events, and probes of watched models."""

from __future__ import annotations

import logging

import typer


def _urls(values: list[str]) -> list[str] | None:
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    return urls or None


def notifier(
    config: str | None = typer.Option(None, help="YAML settings file (fields as LLMGW_* without the prefix)"),
    nats: list[str] = typer.Option([], "--nats", help="NATS URL (repeatable, or a comma list)"),
    prefix: str | None = typer.Option(None, help="Subject and bucket prefix"),
    router_url: str | None = typer.Option(None, help="Router that probes of watched models go through"),
    probe_key: str | None = typer.Option(
        None, help="API key for probes (env LLMGW_PROBE_KEY keeps it off the command line)"
    ),
    group_window: float | None = typer.Option(
        None, "--group-window", help="Seconds within which events of one kind go out as one message"
    ),
    retry_for: float | None = typer.Option(None, "--retry-for", help="Seconds a delivery is retried"),
) -> None:
    """Run the notifier: deliver events to the configured webhooks, and probe watched models."""
    from pydantic import ValidationError

    from llmgw_notifier.service import serve
    from llmgw_notifier.settings import NotifierSettings
    from llmgw_runtime.runtime import run_service, setup_logging
    from llmgw_runtime.settings import load_settings

    overrides = dict(
        nats_urls=_urls(nats),
        prefix=prefix,
        router_url=router_url,
        probe_key=probe_key,
        group_window_s=group_window,
        retry_for_s=retry_for,
    )
    try:
        settings = load_settings(NotifierSettings, config, **overrides)
    except ValidationError as e:
        typer.echo(f"llmgw notifier: bad settings: {e}", err=True)
        raise typer.Exit(2) from None
    setup_logging(settings.log_level, name="notifier")
    # httpx logs every request's full URL at INFO; a Slack webhook URL is a credential.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_service(lambda stop: serve(settings, stop))


def register(app: typer.Typer) -> None:
    app.command("notifier")(notifier)
