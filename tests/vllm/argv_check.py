"""Run with the ``make vllm`` venv's python: parse command lines with vLLM's own argparse.

Reads a JSON list of argument lists on stdin (each after the program: ``["serve", MODEL, ...]`` for
the ``vllm`` command, or ``["--model", MODEL, ...]`` for the api_server module) and prints, as JSON,
for each one ``null`` when vLLM accepts it, else the error vLLM gives. Nothing is started: this is
the parse and the checks vLLM runs on parsed serve arguments before it loads anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def check(argv: list[str]) -> str | None:
    from vllm.entrypoints.cli.serve import ServeSubcommand  # type: ignore[import-not-found]
    from vllm.entrypoints.launchers.cli_args import (  # type: ignore[import-not-found]
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if argv[:1] == ["serve"]:
                top = FlexibleArgumentParser(prog="vllm")
                ServeSubcommand().subparser_init(top.add_subparsers(dest="subcommand"))
                args = top.parse_args(argv)
            else:
                args = make_arg_parser(FlexibleArgumentParser(prog="api_server")).parse_args(argv)
            validate_parsed_serve_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "argparse exited"
    except Exception as e:  # vLLM's own validation: any error is the answer
        return f"{type(e).__name__}: {e}"
    return None


if __name__ == "__main__":
    print(json.dumps([check(a) for a in json.load(sys.stdin)]))
