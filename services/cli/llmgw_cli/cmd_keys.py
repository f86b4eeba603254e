"""``llmgw keys create|list|revoke``: API keys, directly in the ``<prefix>_keys`` bucket."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import typer

from llmgw_common.messages import ApiKeyRecord

keys_app = typer.Typer(help="API keys: create (printed once), list, revoke.", no_args_is_help=True)
T = TypeVar("T")

_NATS = typer.Option([], "--nats", help="NATS URL (repeatable, or a comma list)")
_PREFIX = typer.Option(None, help="Subject and bucket prefix")
_CONFIG = typer.Option(None, help="YAML settings file")
_OUTPUT = typer.Option("table", "-o", "--output", help="table or json")


def _run(
    config: str | None, nats: list[str], prefix: str | None, op: Callable[[Any, str], Awaitable[T]]
) -> T:
    """Connect (once, no endless retries), run ``op(nc, prefix)``, close; exit 1 when NATS is away."""
    from nats.errors import Error as NatsError
    from pydantic import ValidationError

    from llmgw_common import bus
    from llmgw_common.errors import InvalidInput
    from llmgw_common.settings import BusSettings, load_settings
    from llmgw_common.subjects import Subjects

    urls = [u.strip() for v in nats for u in v.split(",") if u.strip()] or None
    try:
        settings = load_settings(BusSettings, config, nats_urls=urls, prefix=prefix)
    except ValidationError as e:
        raise InvalidInput(f"bad settings: {e}") from None

    # The bus client's reconnect warnings would repeat what the one error line below says.
    logging.getLogger("llmgw.bus").setLevel(logging.ERROR)

    async def main() -> T:
        try:
            nc = await bus.connect(settings, "llmgw-keys", connect_timeout=3.0, wait=False)
        except (OSError, TimeoutError, NatsError) as e:
            where = ", ".join(settings.nats_urls)
            typer.echo(f"llmgw keys: cannot reach NATS at {where}: {e or type(e).__name__}", err=True)
            raise typer.Exit(1) from None
        try:
            # The bucket may not exist yet (keys made before the first control plane started): make it
            # with the cluster's replica count, not the helpers' default of 1.
            await bus.ensure_kv(
                nc.jetstream(), Subjects(settings.prefix).bucket_keys, replicas=settings.kv_replicas
            )
            return await op(nc, settings.prefix)
        finally:
            await nc.close()

    return asyncio.run(main())


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
    }


@keys_app.command("create")
def create(
    name: str = typer.Option(..., "--name", help="Who or what the key is for (unique among live keys)"),
    models: str | None = typer.Option(
        None, "--models", help="Comma list of models it may use (default: all)"
    ),
    expires: str | None = typer.Option(None, "--expires", help="Lifetime, e.g. 30d, 12h (default: never)"),
    output: str = _OUTPUT,
    config: str | None = _CONFIG,
    nats: list[str] = _NATS,
    prefix: str | None = _PREFIX,
) -> None:
    """Make a key. It is printed once and never stored: keep it."""
    from llmgw_common.apikeys import KeyOpError, create_key
    from llmgw_common.durations import parse_duration

    try:
        expires_at = time.time() + parse_duration(expires) if expires else None
    except ValueError as e:
        typer.echo(f"llmgw keys create: --expires: {e}", err=True)
        raise typer.Exit(2) from None
    allowed = [m.strip() for m in models.split(",") if m.strip()] if models else None

    async def op(nc: Any, pfx: str) -> tuple[str, ApiKeyRecord]:
        try:
            return await create_key(nc, pfx, name, allowed, expires_at)
        except KeyOpError as e:
            typer.echo(f"llmgw keys create: {e}", err=True)
            raise typer.Exit(1) from None

    key, rec = _run(config, nats, prefix, op)
    if output == "json":
        typer.echo(json.dumps({"key": key, **_row(rec)}))
        return
    typer.echo(key)
    typer.echo(
        f"key {rec.id} ({rec.name}) for {', '.join(rec.models) if rec.models else 'every model'}, "
        f"expires {_when(rec.expires) if rec.expires else 'never'}. It is shown only now.",
        err=True,
    )


@keys_app.command("list")
def list_(
    output: str = _OUTPUT,
    config: str | None = _CONFIG,
    nats: list[str] = _NATS,
    prefix: str | None = _PREFIX,
) -> None:
    """List keys (never their hashes)."""
    from llmgw_common.apikeys import list_keys

    recs = _run(config, nats, prefix, lambda nc, pfx: list_keys(nc, pfx))
    if output == "json":
        typer.echo(json.dumps([_row(r) for r in recs]))
        return
    rows = [("ID", "NAME", "MODELS", "CREATED", "EXPIRES", "REVOKED")]
    for r in recs:
        rows.append(
            (
                r.id,
                r.name,
                ",".join(r.models) if r.models is not None else "*",
                _when(r.created),
                _when(r.expires),
                "yes" if r.revoked else "no",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@keys_app.command("revoke")
def revoke(
    key: str = typer.Argument(..., help="Key id or name"),
    output: str = _OUTPUT,
    config: str | None = _CONFIG,
    nats: list[str] = _NATS,
    prefix: str | None = _PREFIX,
) -> None:
    """Revoke a key: every router refuses it within a tick."""
    from llmgw_common.apikeys import KeyOpError, revoke_key

    async def op(nc: Any, pfx: str) -> ApiKeyRecord:
        try:
            return await revoke_key(nc, pfx, key)
        except KeyOpError as e:
            typer.echo(f"llmgw keys revoke: {e}", err=True)
            raise typer.Exit(1) from None

    rec = _run(config, nats, prefix, op)
    if output == "json":
        typer.echo(json.dumps(_row(rec)))
    else:
        typer.echo(f"revoked {rec.id} ({rec.name})")


@keys_app.command("hash")
def hash_(key: str = typer.Argument(..., help="A key, for a static router file's 'keys' list")) -> None:
    """Print the sha256 of a key (what a record or a static file holds)."""
    from llmgw_common.apikeys import hash_key

    typer.echo(hash_key(key))


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
