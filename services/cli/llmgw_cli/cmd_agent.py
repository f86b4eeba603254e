"""``llmgw agent``: the per-node agent (inventory, assignment, engines)."""

from __future__ import annotations

import logging

import typer


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{what} {v!r} is not key=value")
        out[key.strip()] = val.strip()
    return out


def parse_unhealthy(values: list[str]) -> dict[int, str]:
    """``["3=XID 79"]`` -> ``{3: "XID 79"}``; a non-numeric index names the bad value."""
    out: dict[int, str] = {}
    for key, reason in _pairs(values, "--sim-unhealthy").items():
        if not key.isdigit():
            raise typer.BadParameter(f"--sim-unhealthy {key}={reason!r}: the GPU index must be a number")
        out[int(key)] = reason or "unhealthy"
    return out


def _urls(values: list[str]) -> list[str] | None:
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    return urls or None


def agent(
    config: str | None = typer.Option(None, help="YAML settings file (fields as LLMGW_* without the prefix)"),
    nats: list[str] = typer.Option([], "--nats", help="NATS URL (repeatable, or a comma list)"),
    prefix: str | None = typer.Option(None, help="Subject and bucket prefix"),
    node: str | None = typer.Option(None, help="Node id (default: the host name)"),
    address: str | None = typer.Option(None, help="Address routers use to reach this node's engines"),
    fabric: str | None = typer.Option(None, help="Network fabric this node is on"),
    label: list[str] = typer.Option([], "--label", help="Node label k=v (repeatable)"),
    model_dir: list[str] = typer.Option([], "--model-dir", help="Directory scanned for weights (repeatable)"),
    sim_gpus: str | None = typer.Option(None, help="Simulated GPUs, e.g. 8xH100-80GB"),
    sim_unhealthy: list[str] = typer.Option(
        [], "--sim-unhealthy", help="Simulated unhealthy GPU, e.g. '3=XID 79' (repeatable)"
    ),
    sim_memory_gb: float | None = typer.Option(None, help="Simulated MemTotal in GB"),
    simulate_engines: bool | None = typer.Option(
        None, "--simulate-engines/--real-engines", help="Run every engine as the simulator"
    ),
    state_dir: str | None = typer.Option(None, help="Where the agent keeps its engine state and logs"),
) -> None:
    """Run the agent of one node: report it, and start and stop engines as the control plane assigns."""
    from pydantic import ValidationError

    from llmgw_agent.service import serve
    from llmgw_agent.settings import AgentSettings
    from llmgw_common.subjects import check_token
    from llmgw_runtime.runtime import run_service, setup_logging
    from llmgw_runtime.settings import load_settings

    overrides = dict(
        nats_urls=_urls(nats),
        prefix=prefix,
        node=node,
        address=address,
        fabric=fabric,
        labels=_pairs(label, "--label") or None,
        model_dirs=model_dir or None,
        sim_gpus=sim_gpus,
        sim_unhealthy=parse_unhealthy(sim_unhealthy) or None,
        sim_memory_gb=sim_memory_gb,
        simulate_engines=simulate_engines,
        state_dir=state_dir,
    )
    try:
        settings = load_settings(AgentSettings, config, **overrides)
        check_token(settings.node, "node id")
        check_token(settings.prefix, "prefix")
    except (ValidationError, ValueError) as e:
        typer.echo(f"llmgw agent: bad settings: {e}", err=True)
        raise typer.Exit(2) from None
    setup_logging(settings.log_level, name=f"agent[{settings.node}]")
    # httpx logs every health check and scrape at INFO: once a second per engine is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    run_service(lambda stop: serve(settings, stop))


def register(app: typer.Typer) -> None:
    app.command("agent")(agent)
