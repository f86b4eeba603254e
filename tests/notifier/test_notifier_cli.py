"""``llmgw notifier`` command line: options reach the settings; bad settings exit 2 with the reason."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmgw_cli.main import app


def test_help_lists_the_options() -> None:
    out = CliRunner().invoke(app, ["notifier", "--help"])
    assert out.exit_code == 0
    for opt in ("--nats", "--prefix", "--config", "--router-url", "--probe-key"):
        assert opt in out.output


def test_bad_settings_exit_2_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_CONFIG", raising=False)
    out = CliRunner().invoke(app, ["notifier", "--retry-for", "-1"])
    assert out.exit_code == 2
    assert "bad settings" in out.output and "retry_for_s" in out.output
