"""``llmgw keys create|update|list|revoke|dev|hash``: API keys, directly in the ``<prefix>_keys``
bucket (routers follow it: a change holds everywhere within a tick). ``team`` (``keys_team.py``) and
``usage`` (``cmd_usage.py``) are registered here too."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from llmgw_cli.keys_call import run_on_bus
from llmgw_cli.keys_options import (
    CACHE_SCOPE_HELP,
    CONC,
    CONFIG,
    DAILY,
    MODEL_LIMIT,
    MONTHLY,
    NATS,
    OUTPUT,
    PREFIX,
    RPM,
    TEAM,
    TPM,
    check_cache_scope,
    check_weight,
    limits_from_flags,
    limits_text,
)
from llmgw_cli.keys_team import team_command
from llmgw_common.messages import ApiKeyRecord

keys_app = typer.Typer(
    help="API keys: create (printed once), update limits, list, revoke; team limits.", no_args_is_help=True
)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _row(r: ApiKeyRecord) -> dict[str, Any]:
    return {
        "id": r.id,
        "name": r.name,
        "models": list(r.models) if r.models is not None else None,
        "created": r.created,
        "expires": r.expires,
        "revoked": r.revoked,
        "limits": r.limits.model_dump(exclude_none=True) if r.limits is not None else None,
        "team": r.team,
        "weight": r.weight,
        "cache_scope": r.cache_scope.value,
    }


@keys_app.command("create")
def create(
    name: str = typer.Option(..., "--name", help="Who or what the key is for (unique among live keys)"),
    models: str | None = typer.Option(
        None, "--models", help="Comma list of models it may use (default: all)"
    ),
    expires: str | None = typer.Option(None, "--expires", help="Lifetime, e.g. 30d, 12h (default: never)"),
    rpm: int | None = RPM,
    tpm: int | None = TPM,
    concurrency: int | None = CONC,
    daily_tokens: int | None = DAILY,
    monthly_tokens: int | None = MONTHLY,
    model_limit: list[str] = MODEL_LIMIT,
    team: str | None = TEAM,
    weight: float = typer.Option(1.0, "--weight", help="Share of a saturated model against other keys"),
    cache_scope: str = typer.Option("shared", "--cache-scope", help=CACHE_SCOPE_HELP),
    output: str = OUTPUT,
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """Make a key. It is printed once and never stored: keep it."""
    from llmgw_common.durations import parse_duration
    from llmgw_runtime.apikeys import KeyOpError, create_key

    try:
        expires_at = time.time() + parse_duration(expires) if expires else None
    except ValueError as e:
        typer.echo(f"llmgw keys create: --expires: {e}", err=True)
        raise typer.Exit(2) from None
    allowed = [m.strip() for m in models.split(",") if m.strip()] if models else None
    limits = limits_from_flags(
        "create", None, rpm, tpm, concurrency, daily_tokens, monthly_tokens, model_limit
    )
    check_weight("create", weight)
    scope = check_cache_scope("create", cache_scope, team or None)
    assert scope is not None

    async def op(nc: Any, pfx: str) -> tuple[str, ApiKeyRecord]:
        try:
            return await create_key(
                nc, pfx, name, allowed, expires_at, limits=limits, team=team or None, weight=weight,
                cache_scope=scope,
            )  # fmt: skip
        except KeyOpError as e:
            typer.echo(f"llmgw keys create: {e}", err=True)
            raise typer.Exit(1) from None

    key, rec = run_on_bus(config, nats, prefix, op)
    if output == "json":
        typer.echo(json.dumps({"key": key, **_row(rec)}))
        return
    typer.echo(key)
    typer.echo(
        f"key {rec.id} ({rec.name}) for {', '.join(rec.models) if rec.models else 'every model'}, "
        f"expires {_when(rec.expires) if rec.expires else 'never'}, limits {limits_text(rec)}. "
        "It is shown only now.",
        err=True,
    )


@keys_app.command("update")
def update(
    key: str = typer.Argument(..., help="Key id or name"),
    rpm: int | None = RPM,
    tpm: int | None = TPM,
    concurrency: int | None = CONC,
    daily_tokens: int | None = DAILY,
    monthly_tokens: int | None = MONTHLY,
    model_limit: list[str] = MODEL_LIMIT,
    clear: list[str] = typer.Option(
        [], "--clear", help="Remove a limit: rpm, tpm, concurrency, daily_tokens, monthly_tokens, models"
    ),
    team: str | None = typer.Option(None, "--team", help="Team to share limits with ('' for none)"),
    weight: float | None = typer.Option(None, "--weight", help="Share of a saturated model"),
    cache_scope: str | None = typer.Option(None, "--cache-scope", help=CACHE_SCOPE_HELP),
    output: str = OUTPUT,
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """Change a key's limits, team or weight; what is not given stays. Every router holds the new
    limits within a tick; counts already made in the current windows stay."""
    from llmgw_runtime.apikeys import KeyOpError, list_keys, update_key

    check_weight("update", weight)
    scope = check_cache_scope("update", cache_scope, None)

    async def op(nc: Any, pfx: str) -> ApiKeyRecord:
        recs = await list_keys(nc, pfx)
        cur = next((r for r in recs if r.id == key), None) or next(
            (r for r in recs if r.name == key and not r.revoked), None
        )
        base = cur.limits if cur is not None else None
        limits = limits_from_flags(
            "update", base, rpm, tpm, concurrency, daily_tokens, monthly_tokens, model_limit, clear
        )
        kw: dict[str, Any] = {"limits": limits, "weight": weight, "cache_scope": scope}
        if team is not None:
            kw["team"] = team or None
        try:
            return await update_key(nc, pfx, key, **kw)
        except KeyOpError as e:
            typer.echo(f"llmgw keys update: {e}", err=True)
            raise typer.Exit(1) from None

    rec = run_on_bus(config, nats, prefix, op)
    if output == "json":
        typer.echo(json.dumps(_row(rec)))
    else:
        typer.echo(
            f"updated {rec.id} ({rec.name}): limits {limits_text(rec)}, team {rec.team or '-'}, "
            f"weight {rec.weight:g}, cache scope {rec.cache_scope}"
        )


# Between update and list, where `llmgw keys --help` has always listed it.
keys_app.command("team")(team_command)


@keys_app.command("list")
def list_(
    output: str = OUTPUT,
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """List keys (never their hashes)."""
    from llmgw_runtime.apikeys import list_keys

    recs = run_on_bus(config, nats, prefix, lambda nc, pfx: list_keys(nc, pfx))
    if output == "json":
        typer.echo(json.dumps([_row(r) for r in recs]))
        return
    rows = [("ID", "NAME", "MODELS", "CREATED", "EXPIRES", "REVOKED", "TEAM", "WEIGHT", "CACHE", "LIMITS")]
    for r in recs:
        rows.append(
            (
                r.id,
                r.name,
                ",".join(r.models) if r.models is not None else "*",
                _when(r.created),
                _when(r.expires),
                "yes" if r.revoked else "no",
                r.team or "-",
                f"{r.weight:g}",
                r.cache_scope.value,
                limits_text(r),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@keys_app.command("revoke")
def revoke(
    key: str = typer.Argument(..., help="Key id or name"),
    output: str = OUTPUT,
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """Revoke a key: every router refuses it within a tick."""
    from llmgw_runtime.apikeys import KeyOpError, revoke_key

    async def op(nc: Any, pfx: str) -> ApiKeyRecord:
        try:
            return await revoke_key(nc, pfx, key)
        except KeyOpError as e:
            typer.echo(f"llmgw keys revoke: {e}", err=True)
            raise typer.Exit(1) from None

    rec = run_on_bus(config, nats, prefix, op)
    if output == "json":
        typer.echo(json.dumps(_row(rec)))
    else:
        typer.echo(f"revoked {rec.id} ({rec.name})")


@keys_app.command("dev")
def dev(
    key_file: Path = typer.Option(
        ..., "--key-file", help="Where the key is kept (mode 0600); reused while its record is valid"
    ),
    wait: float = typer.Option(
        0.0, "--wait", help="Seconds to keep trying NATS (a container started together with it)"
    ),
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """The development key, as `llmgw up` makes it, for a cluster started otherwise (docker compose).

    The key in --key-file while its record is valid, else a new one (an earlier development key whose
    file was lost is revoked). Printed on stdout; the same file can feed the notifier's probe key.
    """
    from llmgw_cli.devkey import ensure_dev_key
    from llmgw_common.subjects import Subjects

    async def op(nc: Any, pfx: str) -> tuple[str, bool]:
        kv = await nc.jetstream().key_value(Subjects(pfx).bucket_keys)
        return await ensure_dev_key(kv, pfx, key_file)

    key, minted = run_on_bus(config, nats, prefix, op, wait_s=wait)
    typer.echo(key)
    typer.echo(
        f"development key {'minted' if minted else 'reused'}, kept in {key_file}",
        err=True,
    )


@keys_app.command("hash")
def hash_(key: str = typer.Argument(..., help="A key, for a static router file's 'keys' list")) -> None:
    """Print the sha256 of a key (what a record or a static file holds)."""
    from llmgw_runtime.apikeys import hash_key

    typer.echo(hash_key(key))


def register(app: typer.Typer) -> None:
    from llmgw_cli.cmd_usage import usage_command  # its own module: this one holds the records

    if not any(c.name == "usage" for c in keys_app.registered_commands):
        keys_app.command("usage")(usage_command)
    app.add_typer(keys_app, name="keys")
