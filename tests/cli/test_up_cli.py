"""`llmgw up` refuses clearly, before starting anything, when it cannot run."""

from __future__ import annotations

import fcntl
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw_cli.main import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def up(tmp_path: Path, *args: str) -> tuple[int, str]:
    before = signal.getsignal(signal.SIGINT)
    r = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path / "d"), *args])
    # `up` handles SIGINT while it runs and gives the handler back.
    assert signal.getsignal(signal.SIGINT) is before
    return r.exit_code, r.stderr


def test_bad_fleet_file_lists_its_problems(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes: [{name: n1, gpus: lots}]\n")
    code, err = up(tmp_path, "--fleet", str(fleet))
    assert code == 1
    assert "error: invalid fleet file:" in err
    assert "node 'n1': gpus: GPU spec 'lots' is not '<count>x<CLASS>'" in err
    assert not (tmp_path / "d").exists()


def test_bad_catalog_lists_its_problems(tmp_path: Path) -> None:
    cat = tmp_path / "catalog.yaml"
    cat.write_text("models: [{name: m, engine: vllm}]\n")
    code, err = up(tmp_path, "--catalog", str(cat))
    assert code == 1
    assert "model 'm': engine vllm needs a GPU: set gpu_class" in err


def test_missing_fleet_file_is_named(tmp_path: Path) -> None:
    code, err = up(tmp_path, "--fleet", str(tmp_path / "none.yaml"))
    assert code == 1
    assert f"cannot read {tmp_path / 'none.yaml'}" in err


def test_bad_prefix(tmp_path: Path) -> None:
    code, err = up(tmp_path, "--prefix", "a.b")
    assert code == 1
    assert "error: prefix 'a.b' may contain only letters, digits, '-' and '_'" in err


def test_nats_port_in_use(tmp_path: Path, busy_port: int) -> None:
    code, err = up(tmp_path, "--nats-port", str(busy_port), "--port", "0", "--admin-port", "0")
    assert code == 1
    assert f"port {busy_port} for NATS is in use" in err
    assert "--nats-port -1" in err


def test_router_port_in_use(tmp_path: Path, busy_port: int) -> None:
    code, err = up(tmp_path, "--port", str(busy_port), "--nats-port", "-1")
    assert code == 1
    assert f"port {busy_port} for the router is in use: pass another --port, or 0 for a free one" in err
    assert not (tmp_path / "d" / "nats").exists()  # refused before starting NATS


def test_one_up_per_data_dir(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    with open(d / "up.lock", "w") as f:
        f.write("4242")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, err = up(tmp_path, "--nats-port", "-1", "--port", "0", "--admin-port", "0")
    assert code == 1
    assert f"another `llmgw up` (pid 4242) is running with data directory {d}" in err


@pytest.mark.slow
def test_unreachable_nats(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    code, err = up(tmp_path, "--nats", f"nats://127.0.0.1:{port}", "--port", "0", "--admin-port", "0")
    assert code == 1
    assert f"error: cannot reach NATS at nats://127.0.0.1:{port}" in err
