"""``llmgw agent`` option parsing (the service itself is tested in test_agent_serving.py,
test_agent_lifecycle.py and test_agent_inventory_sends.py)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from llmgw_cli.cmd_agent import parse_unhealthy, register


def app() -> typer.Typer:
    a = typer.Typer()
    register(a)

    @a.command("other")
    def other() -> None:  # a second command keeps "agent" a subcommand
        pass

    return a


def test_parse_unhealthy() -> None:
    assert parse_unhealthy(["3=XID 79", "5=uncorrectable ECC errors: 2", "1="]) == {
        3: "XID 79",
        5: "uncorrectable ECC errors: 2",
        1: "unhealthy",
    }
    with pytest.raises(typer.BadParameter, match="GPU index must be a number"):
        parse_unhealthy(["x=XID 79"])
    with pytest.raises(typer.BadParameter, match="is not key=value"):
        parse_unhealthy(["3"])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--label", "novalue"], "is not key=value"),
        (["--sim-unhealthy", "gpu3=XID"], "GPU index must be a number"),
        (["--node", "bad node"], "bad settings"),
    ],
)
def test_bad_options_exit_2_with_a_reason(args: list[str], needle: str) -> None:
    r = CliRunner().invoke(app(), ["agent", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output
