"""The options every ``llmgw ctl`` command takes, declared once; ``-o`` is an :class:`Output`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from llmgw_common.names import visible


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


def fail(message: str) -> typer.Exit:
    """Say ``message`` on stderr; the caller raises the returned exit (code 1)."""
    typer.echo("error: " + visible(message, keep="\n"), err=True)
    return typer.Exit(1)


def parse_output(value: str) -> Output:
    """``-o``: an unknown value is a failure like any other (exit 1 and why), not a usage error (2)."""
    try:
        return Output(value)
    except ValueError:
        raise fail(f"unknown output {value!r}: use table or json") from None


NatsOpt = Annotated[list[str] | None, typer.Option("--nats", help="NATS URL (repeatable, or a comma list)")]
PrefixOpt = Annotated[str | None, typer.Option("--prefix", help="Subject and bucket prefix")]
ConfigOpt = Annotated[str | None, typer.Option("--config", help="YAML settings file")]
OutOpt = Annotated[Output, typer.Option("-o", "--output", help="table or json", parser=parse_output)]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the control plane")]
