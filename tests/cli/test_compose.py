"""docker-compose.yml stays consistent with the CLI: every command it runs exists and its flags parse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from llmgw_cli.main import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _services() -> list[tuple[str, dict[str, Any]]]:
    return sorted(_compose()["services"].items())


def test_compose_has_the_llmgw_up_topology() -> None:
    services = dict(_services())
    commands = [s.get("command", []) for s in services.values()]
    roles = [c[0] for c in commands if c]
    for role in ("controlplane", "router", "notifier", "agent", "sim-engine"):
        assert role in roles, role
    assert sum(1 for r in roles if r == "agent") >= 2
    assert "nats" in services and "-js" in services["nats"]["command"]


def _parse(args: list[str]) -> int:
    """Exit code of parsing args as the CLI would, without running the command.

    ``--help`` goes last: click rejects an unknown command or option before it reaches it.
    """
    return runner.invoke(app, [*args, "--help"]).exit_code


@pytest.mark.parametrize("name, service", [s for s in _services() if s[1].get("command") and s[0] != "nats"])
def test_every_compose_command_parses(name: str, service: dict[str, Any]) -> None:
    assert _parse([str(a) for a in service["command"]]) == 0


def test_an_unknown_flag_would_be_caught() -> None:
    assert _parse(["router", "--no-such-flag"]) == 2
    assert _parse(["no-such-command"]) == 2
    assert _parse(["router", "--port", "8080"]) == 0


def test_compose_environment_names_are_real_settings() -> None:
    from llmgw_agent.settings import AgentSettings
    from llmgw_controlplane.settings import ControlPlaneSettings
    from llmgw_notifier.settings import NotifierSettings
    from llmgw_router.settings import RouterSettings

    known = set()
    for cls in (AgentSettings, ControlPlaneSettings, NotifierSettings, RouterSettings):
        known |= {f"LLMGW_{n.upper()}" for n in cls.model_fields}
    for name, service in _services():
        for var in service.get("environment") or {}:
            if var.startswith("LLMGW_"):
                assert var in known, f"{name}: {var} is not a setting"
