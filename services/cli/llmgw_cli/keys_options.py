"""The options the ``llmgw keys`` commands share, declared once, and the limit flags read into
:class:`KeyLimits` (a key's and a team's limits take the same flags)."""

from __future__ import annotations

from collections.abc import Sequence

import typer

from llmgw_common.messages import ApiKeyRecord, CacheScope, KeyLimits

NATS = typer.Option([], "--nats", help="NATS URL (repeatable, or a comma list)")
PREFIX = typer.Option(None, help="Subject and bucket prefix")
CONFIG = typer.Option(None, help="YAML settings file")
OUTPUT = typer.Option("table", "-o", "--output", help="table or json")
RPM = typer.Option(None, "--rpm", help="Requests per minute (UTC minute windows)")
TPM = typer.Option(None, "--tpm", help="Tokens per minute, prompt + completion")
CONC = typer.Option(None, "--concurrency", help="Requests in flight at once")
DAILY = typer.Option(None, "--daily-tokens", help="Token budget per UTC day")
MONTHLY = typer.Option(None, "--monthly-tokens", help="Token budget per UTC month")
MODEL_LIMIT = typer.Option(
    [], "--model-limit", help="MODEL:rpm=N,tpm=N,concurrency=N,daily-tokens=N,monthly-tokens=N (repeatable)"
)
TEAM = typer.Option(None, "--team", help="Team whose limits the key shares (`llmgw keys team`)")


def limits_from_flags(
    verb: str,
    base: KeyLimits | None,
    rpm: int | None,
    tpm: int | None,
    concurrency: int | None,
    daily: int | None,
    monthly: int | None,
    model_limits: list[str],
    clear: Sequence[str] = (),
) -> KeyLimits | None:
    """The limits the flags give, over ``base``; exit 2 naming the problem."""
    from pydantic import ValidationError

    from llmgw_common.tenancy import LimitsError, build_limits

    values = {"rpm": rpm, "tpm": tpm, "concurrency": concurrency, "daily_tokens": daily}
    values["monthly_tokens"] = monthly
    try:
        return build_limits(base, values, model_limits, clear=clear)
    except (LimitsError, ValidationError) as e:
        typer.echo(f"llmgw keys {verb}: {e}", err=True)
        raise typer.Exit(2) from None


def check_weight(verb: str, weight: float | None) -> None:
    if weight is not None and not weight > 0:
        typer.echo(f"llmgw keys {verb}: --weight must be above 0, got {weight:g}", err=True)
        raise typer.Exit(2)


CACHE_SCOPE_HELP = (
    "With whom its requests share cached prompt prefixes: shared (every key), team (its team's keys), "
    "key (none); prefix-cache timing is a side channel between tenants"
)


def check_cache_scope(verb: str, scope: str | None, team: str | None) -> CacheScope | None:
    if scope is None:
        return None
    try:
        got = CacheScope(scope)
    except ValueError:
        typer.echo(
            f"llmgw keys {verb}: --cache-scope must be one of {', '.join(c.value for c in CacheScope)}, "
            f"not {scope!r}",
            err=True,
        )
        raise typer.Exit(2) from None
    if got is CacheScope.TEAM and verb == "create" and not team:
        typer.echo(
            f"llmgw keys {verb}: --cache-scope team needs --team (the team whose keys share)", err=True
        )
        raise typer.Exit(2)
    return got


def limits_text(r: ApiKeyRecord) -> str:
    from llmgw_common.tenancy import describe

    return describe(r.limits)
