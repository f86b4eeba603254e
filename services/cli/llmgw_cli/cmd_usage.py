"""``llmgw keys usage [KEY] [--since 7d] [--by model|day|hour] [-o table|json|csv]``: what keys used,
read from the durable ledger (KV ``<prefix>_usage``, ``llmgw_runtime.usage_ledger``), summed over
every router and restart. Registered under ``keys`` by cmd_keys.register."""

from __future__ import annotations

import csv
import io
import json
import time
from typing import Any

import typer

from llmgw_cli.keys_call import run_on_bus
from llmgw_cli.keys_options import CONFIG, NATS, PREFIX
from llmgw_common.messages import ApiKeyRecord
from llmgw_runtime.usage_ledger import By, UsageRow

_FORMATS = ("table", "json", "csv")


def _fail(message: str, status: int = 2) -> typer.Exit:
    typer.echo(f"llmgw keys usage: {message}", err=True)
    return typer.Exit(status)


def _since_seconds(text: str) -> float:
    from llmgw_common.durations import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError:
        raise _fail(f"--since {text!r} is not a duration (use e.g. 24h, 7d, 30d)") from None
    if seconds <= 0:
        raise _fail(f"--since must be longer than 0, got {text!r}")
    return seconds


def _find(recs: list[ApiKeyRecord], key: str) -> ApiKeyRecord:
    """The key by id, else by name (a name reused after revocation: the live one, else the newest)."""
    by_id = next((r for r in recs if r.id == key), None)
    if by_id is not None:
        return by_id
    named = sorted((r for r in recs if r.name == key), key=lambda r: (not r.revoked, r.created))
    if not named:
        raise _fail(f"no key with id or name {key!r} (see `llmgw keys list`)", 1)
    return named[-1]


def usage_command(
    key: str | None = typer.Argument(None, help="Key id or name (all keys when omitted)"),
    since: str = typer.Option("7d", "--since", help="How far back, e.g. 24h, 7d, 30d (whole UTC hours)"),
    by: By = typer.Option(By.MODEL, "--by", help="Sum per model, per UTC day or per UTC hour"),
    output: str = typer.Option("table", "-o", "--output", help="table, json or csv"),
    config: str | None = CONFIG,
    nats: list[str] = NATS,
    prefix: str | None = PREFIX,
) -> None:
    """Requests and tokens in and out per key, from every router's durable usage (exact: each router
    incarnation's hourly totals, counted once)."""
    from llmgw_common.subjects import Subjects
    from llmgw_runtime import bus
    from llmgw_runtime.apikeys import list_keys
    from llmgw_runtime.usage_ledger import fold, read_hours

    if output not in _FORMATS:
        raise _fail(f"-o {output!r}: use one of {', '.join(_FORMATS)}")
    start = time.time() - _since_seconds(since)

    async def op(nc: Any, pfx: str) -> tuple[list[UsageRow], dict[str, str]]:
        recs = await list_keys(nc, pfx)
        wanted = _find(recs, key).id if key is not None else None
        kv = await bus.ensure_kv(nc.jetstream(), Subjects(pfx).bucket_usage)
        rows = fold(await read_hours(kv, start), by, start, wanted)
        return rows, {r.id: r.name for r in recs}

    rows, names = run_on_bus(config, nats, prefix, op)
    typer.echo(render(rows, names, by, output), nl=False)


def render(rows: list[UsageRow], names: dict[str, str], by: By, output: str) -> str:
    header = ["key_id", "key", by.value, "requests", "prompt_tokens", "completion_tokens", "total_tokens"]
    table = [
        [
            r.key_id,
            names.get(r.key_id, "-"),
            r.group,
            r.requests,
            r.prompt_tokens,
            r.completion_tokens,
            r.total_tokens,
        ]
        for r in rows
    ]
    if output == "json":
        return json.dumps([dict(zip(header, row, strict=True)) for row in table]) + "\n"
    if output == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(header)
        w.writerows(table)
        return buf.getvalue()
    if not table:
        return "no usage in that time\n"
    text = [[h.upper() for h in header]] + [[str(c) for c in row] for row in table]
    widths = [max(len(row[i]) for row in text) for i in range(len(header))]
    right = {3, 4, 5, 6}
    return "".join(
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        + "\n"
        for row in text
    )
