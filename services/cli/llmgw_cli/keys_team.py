"""``llmgw keys team NAME``: a team's limits, shared by every key made or updated with ``--team NAME``.
Registered under ``keys`` by cmd_keys."""

from __future__ import annotations

import json
import time
from typing import Any

import typer

from llmgw_cli.keys_call import run_on_bus
from llmgw_cli.keys_options import (
    CONC,
    CONFIG,
    DAILY,
    MODEL_LIMIT,
    MONTHLY,
    NATS,
    OUTPUT,
    PREFIX,
    RPM,
    TPM,
    limits_from_flags,
)
from llmgw_common.messages import KeyLimits, TeamRecord


def team_command(
    name: str = typer.Argument(..., help="Team name (letters, digits, '-', '_')"),
    rpm: int | None = RPM,
    tpm: int | None = TPM,
    concurrency: int | None = CONC,
    daily_tokens: int | None = DAILY,
    monthly_tokens: int | None = MONTHLY,
    model_limit: list[str] = MODEL_LIMIT,
    clear: list[str] = typer.Option([], "--clear", help="Remove a limit (as for `keys update`)"),
    output: str = OUTPUT,
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """Set a team's limits, shared by every key made or updated with --team NAME; with no limit flag,
    show them."""
    from llmgw_common.tenancy import describe
    from llmgw_runtime.apikeys import KeyOpError, list_teams, put_team

    changing = any(v is not None for v in (rpm, tpm, concurrency, daily_tokens, monthly_tokens))
    changing = changing or bool(model_limit) or bool(clear)

    async def op(nc: Any, pfx: str) -> TeamRecord:
        cur = next((t for t in await list_teams(nc, pfx) if t.name == name), None)
        if not changing:
            if cur is None:
                typer.echo(f"llmgw keys team: no team {name!r}", err=True)
                raise typer.Exit(1)
            return cur
        base = cur.limits if cur is not None else None
        lim = limits_from_flags(
            "team", base, rpm, tpm, concurrency, daily_tokens, monthly_tokens, model_limit, clear
        )
        rec = TeamRecord(
            name=name, limits=lim or KeyLimits(), created=cur.created if cur is not None else time.time()
        )
        try:
            return await put_team(nc, pfx, rec)
        except KeyOpError as e:
            typer.echo(f"llmgw keys team: {e}", err=True)
            raise typer.Exit(2) from None

    rec = run_on_bus(config, nats, prefix, op)
    if output == "json":
        typer.echo(json.dumps({"name": rec.name, "limits": rec.limits.model_dump(exclude_none=True)}))
    else:
        typer.echo(f"team {rec.name}: limits {describe(rec.limits)}")
