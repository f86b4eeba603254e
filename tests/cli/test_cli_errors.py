"""An llmgw error that escapes a command is one ``error: <message>`` line and an exit status by kind.

Not a traceback: the message is what the operator acts on (fix the input: 2; retry later: 69).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from llmgw_cli import main as cli_main
from llmgw_common.errors import Conflict, InvalidInput, LlmgwError, Unavailable
from llmgw_runtime.ctl_client import CtlError, CtlUnavailable
from llmgw_runtime.natsserver import NatsServer


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "llmgw_cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60, cwd=cwd)


@pytest.mark.slow
def test_notifier_with_a_prefix_that_is_not_a_token_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    # The notifier checks the prefix when it builds its subjects, after the settings were accepted:
    # the refusal escaped the command as a traceback (exit 1).
    r = run_cli("notifier", "--prefix", "a.b", "--nats", "nats://127.0.0.1:1", cwd=tmp_path)
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: subject prefix 'a.b' may contain only letters, digits, '-' and '_'"
    ]
    assert r.returncode == 2


@pytest.mark.slow
def test_keys_with_a_settings_file_that_is_not_yaml_is_bad_settings_exit_2(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("nats_urls: [\n")
    r = run_cli("keys", "list", "--config", str(tmp_path / "bad.yaml"), cwd=tmp_path)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: bad settings: ")
    assert "not valid YAML" in r.stderr
    assert r.returncode == 2


def _main_with(exc: Exception, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run the real ``main()`` over an app whose one command raises ``exc``; its exit status."""
    app = typer.Typer()

    @app.command("boom")
    def boom() -> None:
        raise exc

    @app.command("other", hidden=True)
    def other() -> None:  # two commands, so that "boom" is a subcommand name
        pass

    monkeypatch.setattr(cli_main, "build_app", lambda only=None: app)
    monkeypatch.setattr(sys, "argv", ["llmgw", "boom"])
    with pytest.raises(SystemExit) as ex:
        cli_main.main()
    assert isinstance(ex.value.code, int)
    return ex.value.code


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidInput("the catalog is wrong"), 2),
        (Unavailable("nats is away"), 69),
        (CtlUnavailable("no control plane answered"), 69),
        (Conflict("changed under us"), 1),
        (CtlError("the control plane said no"), 1),
        (LlmgwError("something else"), 1),
    ],
    ids=["invalid-input", "unavailable", "ctl-unavailable", "conflict", "ctl-error", "base"],
)
def test_main_exit_status_by_kind(
    exc: LlmgwError, status: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main_with(exc, monkeypatch) == status
    assert capsys.readouterr().err == f"error: {exc}\n"


def test_main_shows_control_characters_of_a_message_instead_of_sending_them_to_the_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A message may carry text from outside (a control plane's reply, a file's content).
    _main_with(InvalidInput("bad\x1b]8;;http://x\x07 name\n  - and a second reason"), monkeypatch)
    assert capsys.readouterr().err == "error: bad\\x1b]8;;http://x\\x07 name\n  - and a second reason\n"


def test_main_leaves_other_exceptions_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bug keeps its traceback: only llmgw's reportable errors become one line.
    with pytest.raises(KeyError):
        _main_with(KeyError("bug"), monkeypatch)


async def _no_stream(nc: object) -> None:
    """A real 'no response from stream': a JetStream publish to a subject no stream takes."""
    from nats.aio.client import Client as NATS

    assert isinstance(nc, NATS)
    await nc.jetstream().publish("llmgw-test.nostream.x", b"")


@pytest.mark.slow
def test_a_keys_operation_is_retried_while_jetstream_has_no_answer(
    nats_server: NatsServer, prefix: str
) -> None:
    # A bucket made right before (a cluster just started, R3) answers only once its stream has a
    # leader: `llmgw keys create` in the partition suite's setup died there with a traceback.
    from llmgw_cli.keys_call import run_on_bus

    calls: list[int] = []

    async def op(nc: object, _prefix: str) -> str:
        calls.append(1)
        if len(calls) < 3:
            await _no_stream(nc)
        return "made"

    assert run_on_bus(None, [nats_server.url], prefix, op) == "made"
    assert len(calls) == 3


@pytest.mark.slow
def test_jetstream_never_answering_is_unavailable_saying_nothing_was_written(
    nats_server: NatsServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw_cli import keys_call

    monkeypatch.setattr(keys_call, "JETSTREAM_RETRY_S", 1.0)

    async def op(nc: object, _prefix: str) -> None:
        await _no_stream(nc)

    with pytest.raises(Unavailable, match=r"did not answer for bucket .*_keys .*nothing was written"):
        keys_call.run_on_bus(None, [nats_server.url], prefix, op)
