"""`llmgw up`'s options: a bad one is a one-line error before anything starts, never a traceback;
``--host`` moves the router only, the admin listeners and NATS stay on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_cli.devcluster import Layout, plan_children
from llmgw_cli.fleet import parse_fleet


def run_up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``llmgw up`` as a user runs it (a subprocess: a traceback would reach its output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    argv = [sys.executable, "-m", "llmgw_cli", "up", "--data-dir", str(tmp_path / "d")]
    argv += ["--port", "0", "--admin-port", "0", "--nats-port", "-1", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--host", "nonsense.invalid"], "error: --host 'nonsense.invalid': no such IPv4 address or name"),
        # An address of no interface of this machine.
        (["--host", "192.0.2.1"], "error: --host '192.0.2.1': cannot listen there (Cannot assign requested"),
        (["--host", "::"], "error: --host '::': no such IPv4 address or name"),
        (["--port", "99999"], "error: --port 99999: a port is 0-65535 (0: a free one)"),
        (["--admin-port", "-3"], "error: --admin-port -3: a port is 0-65535 (0: a free one)"),
        (["--nats-port", "70000"], "error: --nats-port 70000: a port is 1-65535 (-1: a free one)"),
        (["--nats-port", "0"], "error: --nats-port 0: a port is 1-65535 (-1: a free one)"),
        (["--ready-timeout", "0"], "error: --ready-timeout 0: must be more than 0 seconds"),
    ],
)
@pytest.mark.slow
def test_a_bad_option_is_one_line_before_anything_starts(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    r = run_up(tmp_path, *args)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.splitlines()[0].startswith(expected), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert not (tmp_path / "d").exists()  # refused before the data directory, NATS or any child


@pytest.mark.slow
def test_a_data_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = run_up(tmp_path, "--data-dir", str(tmp_path / "file" / "d"))
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip() == (
        f"error: cannot use data directory {tmp_path / 'file' / 'd'}: Not a directory"
    ), r.stderr


def layout(tmp_path: Path, host: str) -> Layout:
    return Layout(
        data_dir=tmp_path,
        nats_url="nats://127.0.0.1:1",
        prefix="t",
        host=host,
        router_port=8080,
        router_admin_port=2,
        controlplane_admin_port=3,
        catalog_file=tmp_path / "catalog.yaml",
        dev_key="k",
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7"])
def test_host_moves_the_router_only(tmp_path: Path, host: str) -> None:
    """The admin listeners serve the console and debug endpoints: they refuse to bind off loopback
    (the router's with a ValueError, the control plane's with AdminBindError), which killed `up`."""
    specs = {s.name: s.env for s in plan_children(layout(tmp_path, host), parse_fleet("nodes: []"))}
    assert specs["router"]["LLMGW_HOST"] == host
    assert specs["router"]["LLMGW_ADMIN_HOST"] == "127.0.0.1"
    assert specs["controlplane"]["LLMGW_ADMIN_HOST"] == "127.0.0.1"


def test_router_url_of_a_wildcard_host_is_reachable(tmp_path: Path) -> None:
    """The notifier and `up`'s readiness check connect to the router: 0.0.0.0 is not an address to
    connect to, so they use loopback; a specific address is used as it is."""
    assert layout(tmp_path, "0.0.0.0").router_url == "http://127.0.0.1:8080"
    assert layout(tmp_path, "192.0.2.7").router_url == "http://192.0.2.7:8080"
    assert layout(tmp_path, "127.0.0.1").router_url == "http://127.0.0.1:8080"
