"""The ``llmgw`` command. Each command group lives in its own ``cmd_*`` module with ``register(app)``.

Starting a process should not pay for importing every command: the agent starts one engine process
per shard and ``llmgw up`` starts a dozen services, so ``main()`` imports only the module of the
command being run. ``app`` (all commands, for ``--help`` and tests) is built on first access.
"""

from __future__ import annotations

import importlib
import sys

import typer

from llmgw_common.errors import LlmgwError, exit_status

# Command name -> module, in the order of `llmgw --help`.
COMMANDS: dict[str, str] = {
    "up": "cmd_up",
    "ctl": "cmd_ctl",
    "keys": "cmd_keys",
    "setup": "cmd_setup",
    "controlplane": "cmd_controlplane",
    "router": "cmd_router",
    "agent": "cmd_agent",
    "notifier": "cmd_notifier",
    "sim-engine": "cmd_sim_engine",
}


def build_app(only: str | None = None) -> typer.Typer:
    """The CLI with every command, or only the one named (faster to start)."""
    app = typer.Typer(
        name="llmgw",
        help="LLM serving across a cluster of nodes and GPUs, with NATS as its backbone.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    modules = [COMMANDS[only]] if only in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"llmgw_cli.{name}").register(app)
    if only in COMMANDS:
        # A Typer with one command would run it without its name; a hidden no-op keeps the group shape.
        @app.command("version", hidden=True)
        def version() -> None:
            typer.echo("llmgw")

    return app


def __getattr__(name: str) -> typer.Typer:
    if name == "app":
        full = build_app()
        globals()["app"] = full
        return full
    raise AttributeError(name)


def main() -> None:
    """Run the command named on the command line.

    An :class:`LlmgwError` escaping a command is reported as ``error: <message>`` with an exit status
    by kind (2: fix the input, 69: retry later, else 1), not as a traceback; anything else is a bug
    and keeps its traceback.
    """
    only = sys.argv[1] if len(sys.argv) > 1 else None
    try:
        build_app(only)()
    except LlmgwError as e:
        from llmgw_common.names import visible  # pydantic: not worth importing before a failure

        # Control characters in a message (text from a file or a reply) are shown, not obeyed.
        print("error: " + visible(str(e), keep="\n"), file=sys.stderr, flush=True)
        raise SystemExit(exit_status(e)) from None
