"""The ``llmgw`` command. Each command group lives in its own ``cmd_*`` module with ``register(app)``."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="llmgw",
    help="LLM serving across a cluster of nodes and GPUs, with NATS as its backbone.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Order is the order of `llmgw --help`.
COMMAND_MODULES = (
    "cmd_up",
    "cmd_ctl",
    "cmd_keys",
    "cmd_setup",
    "cmd_controlplane",
    "cmd_router",
    "cmd_agent",
    "cmd_notifier",
    "cmd_sim_engine",
)

for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"llmgw_cli.{_name}")
    except ModuleNotFoundError as e:
        if e.name != f"llmgw_cli.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    app()
